"""Stand-ins with no model behind them: a fake decode instance that registers with a real
gateway, and a fake GenerateService for the benchmark client's self-check."""
