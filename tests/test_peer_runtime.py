"""scripts/peer_runtime.py's round-by-round ratios and the decode's roofline ceiling beside them
(llama.cpp's decode over the weights read once at the round's streaming rate)."""
import pytest
from conftest import load_script


def test_paired_ratios_and_the_decode_ceiling_are_per_round():
    peer = load_script("peer_runtime")
    ours = [{"decode_ms": 5.0, "prefill_tok_s": 1800.0, "weights_mb": 140.0, "stream_read_gb_s": 35.0},
            {"decode_ms": 4.0, "prefill_tok_s": 2000.0, "weights_mb": 140.0, "stream_read_gb_s": 28.0}]
    theirs = [{"decode_ms": 8.0, "prefill_tok_s": 600.0}, {"decode_ms": 7.0, "prefill_tok_s": 800.0}]
    r = peer.paired({"m|2|specplug": ours, "m|2|llama.cpp": theirs}, "m", 2)
    assert r["decode"] == [1.6, 1.75] and r["prefill"] == [3.0, 2.5]
    # round 1: 140 MB at 35 GB/s = 4 ms at the roofline, llama.cpp 8 ms: 2.0x at most; round 2: 5 ms, 7 ms: 1.4x
    assert r["decode_ceiling"] == [2.0, 1.4]
    assert r["decode_ceiling_median"] == pytest.approx(1.7)
