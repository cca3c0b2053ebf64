"""scripts/kernel_builds.load_build: a build by name with the run-time tunings the runtime gives its
own, and `<build>@pairs<N>` to time tile-pair thresholds side by side."""
import pytest

from conftest import load_script
from specplug.runtime import native


def test_a_build_gets_this_cpus_pair_thresholds_or_the_ones_it_names():
    kb = load_script("kernel_builds")
    isa = native.chosen_isa()
    ext = native.kernels(isa)
    if not hasattr(ext, "byte_pair_rows") or ext.pair_rows() == 0:
        pytest.skip(f"the {isa} build has no tile pairs (AVX-512 only)")
    before = ext.pair_rows(), ext.byte_pair_rows()
    try:
        assert kb.load_build(f"{isa}@pairs4") is ext  # the same module: the setting is the module's
        assert (ext.pair_rows(), ext.byte_pair_rows()) == (4, 4)
        kb.load_build(isa)
        assert (ext.pair_rows(), ext.byte_pair_rows()) == native.pair_rows()
    finally:
        ext.set_pair_rows(*before)


@pytest.mark.parametrize("name", ["avx512@pairs0", "avx512@pairs", "avx512@rows3", "avx512@pairs-1"])
def test_a_wrong_tuning_is_one_clear_error_before_anything_loads(name):
    kb = load_script("kernel_builds")
    with pytest.raises(SystemExit, match=r"the only tuning is @pairs<N>, N >= 1"):
        kb.load_build(name)
