"""bench_model's point on a tiny random model (fast): the existing keys stay, and the cost of
recording attention comes beside the plain paged decode, with its bookkeeping checked."""

import numpy as np
import pytest

import kvquota as kq
from experiments import bench_model


@pytest.mark.slow  # ~8 s of timed decode: the default run's budget (issue #13)
def test_point_times_decode_with_and_without_recording_attention():
    config = kq.get_model_config("tiny-qwen")
    params = kq.init_params(config, seed=0, scale=0.1)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, 20)] for _ in range(2)]
    point = bench_model.bench_point(config, params, prompts, steps=2, chunk=16, block=8,
                                    kv_format="f32")
    assert {"prefill_tokens_per_s", "prefill_seconds", "decode_tokens_per_s", "decode_step_ms",
            "same_greedy_tokens", "load_average_1min"} <= set(point)
    rec = point["record_attention"]
    step = rec["decode_step_ms"]
    assert step["off"] == point["decode_step_ms"]["paged"] and step["on"] > 0
    assert step["ratio"] == pytest.approx(step["on"] / step["off"])
    assert rec["same_greedy_tokens"] is True  # recording leaves the logits bitwise alone
    assert rec["recorded_mass"] == pytest.approx(1.0, rel=1e-5)
    assert "recording attention" in bench_model.describe_point(point)
