"""The speculator built in docs/writing-a-plugin.md works as the guide says."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "specplug-bigram"))
from specplug_bigram import Bigram  # noqa: E402

from specplug.errors import ConfigError  # noqa: E402
from specplug.testing import assert_greedy_equal  # noqa: E402


def test_bigram_is_lossless_and_drafts(tiny_target, tiny_target_info):
    tok = tiny_target.tokenizer
    prompts = [tok.encode("the cat sat on the mat and the cat sat on the mat and the cat"), tok.encode("hello")]
    spec = Bigram(Bigram.Params(min_count=1), tiny_target_info)
    eng = assert_greedy_equal(tiny_target, [spec], prompts, 40, n_parallel=2)
    st = eng.stats.speculators["Bigram"]
    assert st.drafted_tokens > 0 and spec.drafted == st.drafted_tokens and spec.accepted == st.accepted_tokens


def test_bigram_params_are_checked():
    with pytest.raises(ConfigError, match="min_count"):
        Bigram(Bigram.Params(min_count=0), None)


def test_guide_code_matches_the_example_package():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md").read_text()
    code = (Path(__file__).resolve().parents[1] / "examples/specplug-bigram/specplug_bigram/__init__.py").read_text()
    assert code.strip() in guide


def test_the_guides_test_example_runs(tiny_target, tiny_target_info):
    guide = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md").read_text()
    section = guide[guide.index("## 5. Test it"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 9)]
    scope: dict = {}
    exec(compile(code, "writing-a-plugin.md", "exec"), scope)
    scope["test_lossless"](tiny_target, tiny_target_info)
