"""Build the optional Cython hot-path extensions in ninfer/_hot/.

Each extension has a pure-Python twin (`ninfer/_hot/*_py.py`); if Cython or a C compiler is
missing, or a build fails, the install still succeeds and the twin is used at run time.
"""
import glob
import os

from setuptools import find_namespace_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure falls back to Python
            print(f"ninfer: Cython extensions not built ({exc}); using the pure-Python fallback")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"ninfer: extension {ext.name} not built ({exc}); using the pure-Python fallback")


def hot_extensions():
    if os.environ.get("NINFER_NO_CYTHON"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    sources = sorted(glob.glob("ninfer/_hot/*.pyx"))
    if not sources:
        return []
    # typed memoryviews only: no numpy headers, so numpy is not a build requirement
    return cythonize(sources, compiler_directives={"language_level": "3"}, quiet=True)


class BuildPyWithKernelPack(build_py):
    """NINFER_KERNEL_PACK=90,89,80 (architectures): also compile the kernels of every Qwen3.5
    release geometry to PTX into ninfer/kernels/prebuilt, so the built wheel starts those models
    without compiling (docs/gpu.md). Needs numba-cuda where the build runs: build with
    `pip wheel --no-build-isolation .` in an environment that has the [cuda] extra. An editable
    install writes the pack into the source tree's kernels/prebuilt (ignored by git)."""

    def run(self):
        super().run()
        archs = os.environ.get("NINFER_KERNEL_PACK", "").strip()
        if not archs:
            return
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ninfer.models.qwen3_5.releases import build_release_pack
        if getattr(self, "editable_mode", False):
            out = os.path.join("kernels", "prebuilt")
        else:
            out = os.path.join(self.build_lib, "ninfer", "kernels", "prebuilt")
        n, seconds = build_release_pack(out, archs)
        print(f"ninfer: kernel pack of {n} kernels for {archs} in {out} ({seconds:.0f} s)")


# The numba-cuda kernel sources stay in the top-level kernels/ (the design card's place) and ship
# inside the package as `ninfer.kernels`; core/cuda/kernels.py reads them through importlib, so a
# wheel and an editable install find the same files.
setup(packages=find_namespace_packages(include=["ninfer", "ninfer.*"], exclude=["*.__pycache__"])
      + ["ninfer.kernels"],
      package_dir={"ninfer.kernels": "kernels"},
      ext_modules=hot_extensions(), cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithKernelPack})
