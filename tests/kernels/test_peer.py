"""Cross-check against a peer no one here wrote: `jax.experimental.pallas.ops.gpu.paged_attention`.

The peer takes a pre-scaled q, needs `pages_per_sequence % k_splits == 0` and `block_h % 16 == 0`,
multiplies masked probabilities by V (NaN in unused slots leaks through) and disagrees with its
own reference at length 0, so it is compared on finite data and lengths >= 1 only.
"""

import math

import jax
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as peer

from kernels import paged_attention as pa
from tests.kernels.cases import assert_close, make_case

INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize("kv_heads,ratio,page,d", [(2, 3, 16, 64), (1, 7, 8, 128)])
def test_matches_peer_kernel_and_reference(kv_heads, ratio, page, d):
    max_blocks = 4
    lengths = [1, page, max_blocks * page, 2 * page + 5]
    # Past-length entries point at real blocks: the peer loads whole compute blocks of pages.
    c = make_case(51, batch=4, q_heads=kv_heads * ratio, kv_heads=kv_heads, head_dim=d,
                  page_size=page, max_blocks=max_blocks, lengths=lengths, nan_fill=False,
                  past_length="arbitrary")
    scale = 1 / math.sqrt(d)
    ours = pa.decode(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths, backend="reference")
    ours_kernel = pa.decode(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths,
                            backend="pallas")
    theirs = peer.paged_attention(
        c.q * scale, c.k_pages, c.v_pages, c.block_tables, c.lengths, k_splits=2,
        pages_per_compute_block=2, interpret=INTERPRET,
    )
    theirs_ref = peer.paged_attention_reference(c.q * scale, c.k_dense, c.v_dense, c.lengths)
    assert_close(theirs, theirs_ref, np.float32, "peer kernel vs peer reference")
    assert_close(ours, theirs_ref, np.float32, "our reference vs peer reference")
    assert_close(ours_kernel, theirs, np.float32, "our kernel vs peer kernel")
