"""`pdserve profile`: the fits, the file's schema, and a measurement on a tiny model."""
from __future__ import annotations

import json

import pytest

from bench.profile import (
    DecodeSample,
    LinearFit,
    PrefillSample,
    Profile,
    cpu_family_model,
    fit_decode,
    fit_linear,
    fit_prefill,
    main,
)


def test_fit_recovers_known_coefficients():
    # decode step = 5 ms + 0.5 ms per sequence + 2 ms per thousand context tokens
    samples = [DecodeSample(batch_size=b, total_context_tokens=b * c, seconds=0.005 + 0.0005 * b + 0.002 * b * c / 1000)
               for b in (1, 4, 16) for c in (128, 512)]
    fit = fit_decode(samples)
    assert fit.intercept_s == pytest.approx(0.005)
    assert fit.coefficients == {"batch": pytest.approx(0.0005), "context": pytest.approx(0.002)}
    assert fit.r2 == pytest.approx(1.0)


def test_prefill_fit_and_prediction_agree_on_the_attention_term():
    # 1 ms + 10 us per token + 3 us per unit of n (k + n/2) / 1000
    def seconds(n, k):
        return 0.001 + 1e-5 * n + 3e-6 * n * (k + n / 2) / 1000
    samples = [PrefillSample(num_new_tokens=n, num_cached_tokens=k, seconds=seconds(n, k))
               for n in (32, 256, 1024) for k in (0, 512)]
    fit = fit_prefill(samples)
    profile_like = Profile.model_construct(prefill_fit=fit)
    assert Profile.prefill_step_s(profile_like, [(300, 100)]) == pytest.approx(seconds(300, 100))


def test_a_negative_coefficient_is_dropped_so_more_work_never_predicts_less_time():
    fit = fit_linear({"tokens": [1, 2, 3, 4], "noise": [4, 1, 3, 2]}, [1.0, 2.0, 3.0, 4.1])
    assert all(c >= 0 for c in fit.coefficients.values()) and set(fit.coefficients) == {"tokens", "noise"}
    assert fit.predict(tokens=5, noise=0) > fit.predict(tokens=4, noise=0)


def test_profile_schema_rejects_a_bad_file(tmp_path):
    with pytest.raises(ValueError):
        Profile.model_validate({"machine": {}, "prefill_fit": {"intercept_s": -1, "coefficients": {}}})
    with pytest.raises(ValueError):
        LinearFit(intercept_s=-0.1, coefficients={})


def test_profile_command_measures_a_tiny_model(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["--out", str(out), "--model", str(tiny_llama_dir), "--kv-cache-memory", "64MiB",
                 "--prefill-tokens", "16,64", "--cached-tokens", "0,32", "--batch-sizes", "1,4",
                 "--contexts", "32", "--decode-steps", "3", "--reps", "1", "--no-transfer"]) == 0
    profile = Profile.load(out)
    assert {(s.num_new_tokens, s.num_cached_tokens) for s in profile.prefill_samples} == {
        (16, 0), (64, 0), (16, 32), (64, 32)}
    assert [s.batch_size for s in profile.decode_samples] == [1, 4]
    # Context while decoding: the 32-token prompt plus the tokens generated so far.
    assert all(32 * s.batch_size < s.total_context_tokens < 40 * s.batch_size for s in profile.decode_samples)
    assert profile.machine.num_threads == 1 and profile.machine.cpu_model
    assert profile.versions.pdserve
    assert profile.engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K,V x layers x heads x dim x fp32
    assert profile.prefill_step_s([(64, 0)]) > 0 and profile.decode_step_s(4, 140) > 0
    assert json.loads(out.read_text())["schema_version"] == 1


def test_decode_steps_follow_the_samples_where_the_batch_is_not_linear():
    # Measured: 2 sequences slower than 1 or 4 (a different matmul kernel); the linear
    # fit alone would miss that, the samples' residuals put it back.
    samples = [DecodeSample(batch_size=b, total_context_tokens=100 * b, seconds=t)
               for b, t in ((1, 0.10), (2, 0.30), (4, 0.12))]
    fit = fit_decode(samples)
    profile = Profile.model_construct(decode_fit=fit, decode_samples=samples)
    assert [round(profile.decode_step_s(b, 100 * b), 6) for b in (1, 2, 4)] == [0.10, 0.30, 0.12]
    assert profile.decode_step_s(3, 300) == pytest.approx((0.30 + 0.12) / 2, abs=0.02)
    assert profile.decode_step_s(16, 1600) == pytest.approx(fit.predict(batch=16, context=1.6))  # beyond: the fit


def test_a_mixed_step_costs_its_decode_rows_as_extra_tokens_not_a_second_pass():
    profile = Profile.model_construct(
        prefill_fit=LinearFit(intercept_s=0.05, coefficients={"tokens": 0.004, "attention": 0.0}),
        decode_fit=LinearFit(intercept_s=0.09, coefficients={"batch": 0.001, "context": 0.0}), decode_samples=[])
    # 100 prompt tokens + 4 decode rows in one pass: 0.05 + 0.004 x 104.
    assert profile.mixed_step_s([(100, 0)], 4, 400) == pytest.approx(0.05 + 0.004 * 104)
    # A tiny chunk does not make the step cheaper than the decodes alone.
    assert profile.mixed_step_s([(1, 0)], 4, 400) == pytest.approx(profile.decode_step_s(4, 400))


@pytest.mark.parametrize("cpuinfo, expected", [
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\n"
     "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n", "family 26, model 2"),  # the first processor's
    ("processor\t: 0\nmodel name\t: some ARM core\n", ""),  # no x86 family: nothing, not a guess
])
def test_the_cpu_family_and_model_come_from_the_first_processor(cpuinfo, expected):
    assert cpu_family_model(cpuinfo) == expected
