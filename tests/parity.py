"""Helpers comparing our engine with Hugging Face transformers on the same weights."""
from __future__ import annotations

import torch


def hf_greedy(hf_model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_token_ids], device=hf_model.device)
    with torch.inference_mode():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=0, temperature=None,
                                top_p=None, top_k=None)
    return out[0, len(prompt_token_ids):].tolist()


def hf_teacher_forced_logprobs(hf_model, prompt_token_ids: list[int],
                               output_token_ids: list[int]) -> torch.Tensor:
    """log P(output_token_ids[i] | prefix) for each i: [num_output_tokens]."""
    return hf_teacher_forced(hf_model, prompt_token_ids, output_token_ids)[0]


def hf_teacher_forced(hf_model, prompt_token_ids: list[int],
                      output_token_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """One forward over prompt + output: log P(output_token_ids[i] | prefix) for each i
    ([num_output_tokens]), and the token Hugging Face's greedy decoding picks after each
    of those prefixes (its argmax). The picks equal output_token_ids exactly when HF's
    own greedy generation would have produced them, one forward instead of one per token."""
    ids = torch.tensor([prompt_token_ids + output_token_ids], device=hf_model.device)
    with torch.inference_mode():
        logits = hf_model(ids).logits[0].float().cpu()  # [seq_len, vocab]
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt_token_ids) - 1
    positions = torch.arange(start, start + len(output_token_ids))
    return logprobs[positions, torch.tensor(output_token_ids)], logits[positions].argmax(dim=-1).tolist()
