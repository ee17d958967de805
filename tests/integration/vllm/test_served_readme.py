"""The README's served blocks run as written against the session's real `vllm serve` (the tie
model, the job opted in, `--enable-scale-out` for `/inference/v1/generate`): ``served-stream``
(a streamed completion's chunks decoded with ``decode_stream``) and ``served-generate`` (token in,
token out, vLLM's ``sampling_mask`` filled on CPU). Every row is exact and holds its sampled
token; the mask rows are those rows' ids, ascending. (Streamed rows equal unstreamed ones:
test_served.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import readme_blocks
from support.upstream import need
from test_served import server_model

pytestmark = pytest.mark.timeout(300)


def test_stream_block(server):
    need("vllm")
    ns = readme_blocks.run("served-stream", {"url": server.base, "m": server_model(server)})
    support = ns["replay"].support
    tokens = [t for c in ns["chunks"] for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert len(tokens) == len(support) == 4 and support.width == 20 + 16
    assert support.exact.all() and (support.sampled == np.asarray(tokens)).all()
    assert all(tok in row for tok, row in zip(tokens, support.ids.tolist()))


def test_generate_block(server):
    need("vllm")
    ns = readme_blocks.run("served-generate", {"url": server.base, "m": server_model(server)})
    choice, support = ns["choice"], ns["replay"].support
    mask = choice["sampling_mask"]
    assert len(mask) == len(choice["token_ids"]) == len(support) > 0
    assert support.exact.all()
    for row, ids, tok in zip(mask, support.ids, choice["token_ids"]):
        assert row == sorted(row) and tok in row
        assert row == sorted(int(i) for i in ids if i >= 0)
