"""Build comera: the C kernels as a C11 static library, then the torch glue.

torch's BuildExtension compiles every non-.cu source as C++, so the C files
(csrc/cpu/*.c) get their own build step with C flags and are linked into the
extension as a static library.

Environment:
  COMERA_CUDA=auto|0|1   build the CUDA kernels (auto: torch was built with
                         CUDA and nvcc is found; never asks for a GPU)
  TORCH_CUDA_ARCH_LIST   CUDA architectures (default includes sm_90)
  CC                     C compiler for the kernels (default: cc)
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
C_FLAGS = ["-std=c11", "-O3", "-fopenmp", "-fPIC", "-Wall", "-Wextra", "-fno-strict-aliasing"]


def _cuda_choice():
    import torch
    from torch.utils import cpp_extension

    want = os.environ.get("COMERA_CUDA", "auto").strip().lower()
    if want not in ("auto", "0", "1"):
        sys.exit(f"COMERA_CUDA must be auto, 0 or 1, got {want!r}")
    cu_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    torch_cuda = torch.version.cuda is not None
    nvcc = cpp_extension.CUDA_HOME is not None and os.path.exists(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    )
    if want == "0":
        return False, "off (COMERA_CUDA=0)"
    if want == "1":
        if not torch_cuda:
            sys.exit("COMERA_CUDA=1 but this torch was built without CUDA")
        if not nvcc:
            sys.exit("COMERA_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        return bool(cu_sources), "on (COMERA_CUDA=1)" if cu_sources else "on, but no CUDA sources yet"
    if not torch_cuda:
        return False, "off (auto: torch has no CUDA)"
    if not nvcc:
        return False, "off (auto: nvcc not found)"
    if not cu_sources:
        return False, "off (auto: no CUDA sources yet)"
    return True, "on (auto)"


def _build_c_library(build_temp):
    """Compiles csrc/cpu/*.c with the C compiler into libcomera_cpu.a."""
    cc = os.environ.get("CC", "cc")
    obj_dir = os.path.join(build_temp, "comera_c")
    os.makedirs(obj_dir, exist_ok=True)
    objects = []
    for src in sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.c"))):
        obj = os.path.join(obj_dir, os.path.basename(src)[:-2] + ".o")
        cmd = [cc, *C_FLAGS, "-I", os.path.join(ROOT, "csrc", "include"), "-c", src, "-o", obj]
        print(" ".join(cmd))
        subprocess.check_call(cmd)
        objects.append(obj)
    lib = os.path.join(obj_dir, "libcomera_cpu.a")
    if os.path.exists(lib):
        os.remove(lib)
    subprocess.check_call(["ar", "rcs", lib, *objects])
    return lib


def main():
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    with_cuda, why = _cuda_choice()
    print(f"comera build configuration: CUDA {why}; C kernels: C11 -O3 OpenMP; "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(default)')}")
    if with_cuda and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"

    class BuildWithC(BuildExtension):
        def build_extensions(self):
            lib = _build_c_library(self.build_temp)
            for ext in self.extensions:
                ext.extra_objects = [lib] + list(ext.extra_objects or [])
            super().build_extensions()

    sources = sorted(glob.glob(os.path.join("csrc", "torch", "*.cpp")))
    cxx_flags = ["-O3", "-std=c++17", "-Wall"]
    define_macros = []
    ext_cls = CppExtension
    kwargs = {}
    if with_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "torch", "cuda", "*.cpp")))
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        define_macros.append(("COMERA_WITH_CUDA", "1"))
        ext_cls = CUDAExtension
        kwargs["libraries"] = ["cublas"]
        extra = {"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]}
    else:
        extra = {"cxx": cxx_flags}
    ext = ext_cls(
        "comera._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        define_macros=define_macros,
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
        **kwargs,
    )
    setup(ext_modules=[ext], cmdclass={"build_ext": BuildWithC})


if __name__ == "__main__":
    main()
