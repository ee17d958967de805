"""``replay-plugin bench wire``: the route wire format against JSON lists and skyrl's codec.

Routes ``[8192, 48, 8]`` uint8 (``quick``: ``[1024, 48, 8]``), one process, medians of warm
repetitions, throughput in MB/s of raw array bytes. The decode-from-body figures use a generate
endpoint's response body written by :func:`replay_plugin.core.wire.dumps`. The peer, skyrl
0.4.0's route codec, is measured when skyrl is importable.
"""

from __future__ import annotations

import importlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from replay_plugin.bench import Result
from replay_plugin.core import routes as core_routes
from replay_plugin.core import wire

BENCH = "wire"
ROUTE_DTYPES = ("uint8", "int16", "int32")


def _per_call(fn: Callable[[], Any], *, calls: int, repeats: int) -> float:
    """Median seconds per call over ``repeats`` timings of ``calls`` calls, after a warm-up."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def _interleaved(
    ours: Callable[[], Any], theirs: Callable[[], Any], *, calls: int, repeats: int
) -> tuple[float, float, float]:
    """Seconds per call of each, and the median of per-round ``theirs / ours`` ratios.

    Rounds alternate between the two so that load from other processes on a shared machine
    hits both alike.
    """
    for fn in (ours, theirs, ours, theirs):
        fn()
    mine, peer, ratios = [], [], []
    for _ in range(repeats):
        pair = []
        for fn in (ours, theirs):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            pair.append((time.perf_counter() - start) / calls)
        mine.append(pair[0])
        peer.append(pair[1])
        ratios.append(pair[1] / pair[0])
    return statistics.median(mine), statistics.median(peer), statistics.median(ratios)


def _check(ok: bool, what: str) -> None:
    if not ok:  # a benchmark of wrong results would be meaningless
        raise RuntimeError(f"bench wire: {what} failed")


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _peer() -> Any:
    return importlib.import_module("skyrl.backends.skyrl_train.inference_servers.generate_wire")


def run(quick: bool = False) -> list[Result]:
    """Measure the wire format; see the module docstring for what each figure means."""
    tokens = 1024 if quick else 8192
    calls, repeats = (3, 5) if quick else (10, 9)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 128, size=(tokens, 48, 8), dtype=np.uint8)
    raw = arr.nbytes
    shape = f"[{tokens}, 48, 8] uint8"
    results: list[Result] = []

    def add(metric: str, value: float | None, unit: str = "", goal: str | None = None, note: str = "") -> None:
        results.append(Result(BENCH, metric, value, unit, goal, note))

    # ---- size --------------------------------------------------------------------------
    doc = wire.dumps({"routed_experts": arr})
    as_json = json.dumps(arr.tolist()).encode()
    add(
        "document bytes / raw bytes",
        len(doc) / raw,
        "x",
        "<= 1.34",
        f'{shape}; doc = dumps({{"routed_experts": routes}})',
    )
    add("json.dumps(tolist) bytes / document bytes", len(as_json) / len(doc), "x", ">= 3")

    # ---- bodies --------------------------------------------------------------------------
    body_doc = {
        "choices": [{"index": 0, "token_ids": list(range(tokens // 8)), "finish_reason": "stop", "routed_experts": arr}]
    }
    body = wire.dumps(body_doc)
    parsed_env = orjson.loads(body)["choices"][0]["routed_experts"]  # data is a str, as a client holds it
    _check(
        np.array_equal(wire.decode_array(parsed_env), arr)
        and np.array_equal(wire.loads(body)["choices"][0]["routed_experts"], arr),
        "wire round trip",
    )

    def ours_encode() -> Any:
        return wire.encode_array(core_routes.compact(arr))

    def ours_decode_parsed() -> Any:
        return wire.decode_array(parsed_env, dtypes=ROUTE_DTYPES, ndim=3)

    def ours_decode_body() -> Any:
        return wire.loads(body)["choices"][0]["routed_experts"]

    t_encode = _per_call(ours_encode, calls=calls, repeats=repeats)
    t_dumps = _per_call(lambda: wire.dumps(body_doc), calls=calls, repeats=repeats)
    t_parsed = _per_call(ours_decode_parsed, calls=calls, repeats=repeats)
    t_body = _per_call(ours_decode_body, calls=calls, repeats=repeats)
    t_plain = _per_call(
        lambda: wire.decode_array(orjson.loads(body)["choices"][0]["routed_experts"]), calls=calls, repeats=repeats
    )
    add("encode MB/s (compact + encode_array)", _mbps(raw, t_encode), "MB/s")
    add("dumps MB/s (response body)", _mbps(raw, t_dumps), "MB/s")
    add(
        "decode MB/s from a parsed document",
        _mbps(raw, t_parsed),
        "MB/s",
        ">= 3000",
        "decode_array(envelope); parsing not timed",
    )
    add("decode MB/s from the raw body", _mbps(raw, t_body), "MB/s", ">= 3000", "wire.loads(body), parse included")
    add(
        "decode MB/s, orjson.loads(body) + decode_array",
        _mbps(raw, t_plain),
        "MB/s",
        None,
        "a client that parses with plain orjson",
    )

    # ---- round trip vs JSON lists --------------------------------------------------------
    def json_round_trip() -> Any:
        return np.array(json.loads(json.dumps(arr.tolist())), dtype=np.uint8)

    def ours_round_trip() -> Any:
        return wire.loads(wire.dumps({"routed_experts": arr}))["routed_experts"]

    t_json = _per_call(json_round_trip, calls=1, repeats=3 if quick else 5)
    t_ours = _per_call(ours_round_trip, calls=calls, repeats=repeats)
    add(
        "round trip speed-up vs json (tolist/dumps/loads/np.array)",
        t_json / t_ours,
        "x",
        ">= 100",
        f"json {t_json * 1e3:.1f} ms, wire dumps+loads {t_ours * 1e3:.2f} ms",
    )

    # ---- peer: skyrl 0.4.0 ---------------------------------------------------------------
    try:
        peer = _peer()
    except Exception as exc:  # noqa: BLE001 - any import failure means "peer not measurable here"
        add("vs skyrl route codec", None, note=f"skyrl not importable in this Python ({type(exc).__name__}: {exc})")
        return results

    def peer_encode() -> Any:
        return peer.pack_routed_experts(arr)

    def peer_decode_parsed() -> Any:
        return peer.decode_packed_routed_experts(parsed_env)

    def peer_decode_body() -> Any:
        return peer.decode_packed_routed_experts(peer.load_packed_body(body)["choices"][0]["routed_experts"])

    _check(peer_encode() == wire.encode_array(arr), "skyrl's envelope differs from ours")
    _check(np.array_equal(peer_decode_parsed(), arr) and np.array_equal(peer_decode_body(), arr), "skyrl decode")
    note = "interleaved with ours, median of per-round ratios"
    for label, ours, theirs, extra in (
        ("encode", ours_encode, peer_encode, "pack_routed_experts vs compact + encode_array"),
        (
            "decode, parsed document",
            ours_decode_parsed,
            peer_decode_parsed,
            "skyrl also scans min/max to reject a non-canonical dtype",
        ),
        ("decode, raw body", ours_decode_body, peer_decode_body, "load_packed_body + decode vs wire.loads"),
    ):
        t_ours, t_peer, ratio = _interleaved(ours, theirs, calls=calls, repeats=repeats)
        add(
            f"skyrl {label} MB/s",
            _mbps(raw, t_peer),
            "MB/s",
            None,
            f"{extra}; ours {_mbps(raw, t_ours):.0f} MB/s in the same rounds",
        )
        add(f"{label} speed vs skyrl", ratio, "x", ">= 1", note)
    return results


if __name__ == "__main__":  # pragma: no cover - manual runs
    import sys

    from replay_plugin.bench import format_table

    print(format_table(run(quick="--quick" in sys.argv)))
