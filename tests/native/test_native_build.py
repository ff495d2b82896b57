"""The native extension is built by the package build (scikit-build-core + CMake) and imports."""

from serving_image.constraints import _native


def test_native_extension_is_importable_and_reports_its_abi():
    assert _native.ABI_VERSION == 2
    assert _native.hardware_threads() >= 1
