"""Build comera: the C kernels as a C11 static library, then the torch glue.

torch's BuildExtension compiles every non-.cu source as C++, so the C kernels
(COMERA_C_SOURCES in csrc/build.mk, the one source of their flags) get their
own build step with C flags and are linked into the extension modules as a
static library.  Two modules, both on the LibTorch stable ABI:

  comera._C       csrc/registration.cpp (every schema) and csrc/<op>/op.cpp:
                  the CPU kernels.  Always built.
  comera._C_cuda  csrc/cuda_module.cpp, csrc/<op>/op.cpp compiled with
                  COMERA_WITH_CUDA (registers the CUDA kernels only) and
                  csrc/<op>/*.cu.  Needs nvcc and torch's stable headers, not a
                  CUDA build of torch; comera imports it only under a torch
                  with CUDA, whose libcudart and libcublas it then uses.

Environment:
  COMERA_CUDA=auto|nvcc|0|1  build comera._C_cuda.  auto (the default): torch
                         was built with CUDA and nvcc is found; nvcc: nvcc is
                         found, whatever torch (`make wheel`); 1: required
                         (an error without nvcc); 0: never.  Never asks for a GPU.
  TORCH_CUDA_ARCH_LIST   CUDA architectures (default 8.0;9.0;10.0)
  COMERA_CUBLAS_INCLUDE  a folder holding cublas_v2.h when neither the CUDA
                         toolkit nor an nvidia-cublas wheel in this Python has
                         it (with libcublas.so.N in ../lib): tools/cublas_include.sh
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
CSRC = os.path.join(ROOT, "csrc")


def _read_build_mk(path=os.path.join(CSRC, "build.mk")):
    """The `NAME = value` lines of csrc/build.mk (with backslash continuations)."""
    with open(path) as f:
        text = f.read().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        if "=" in line:
            name, value = line.split("=", 1)
            out[name.strip()] = value.split()
    return out


BUILD_MK = _read_build_mk()
C_FLAGS = (BUILD_MK["COMERA_C_STD"] + BUILD_MK["COMERA_C_WARN"] + BUILD_MK["COMERA_C_OPENMP"]
           + ["-O3", "-fPIC", "-fno-strict-aliasing"])
# The stable-ABI version the glue targets: torch 2.13 ((major << 56) | (minor << 48)).
TORCH_TARGET_VERSION = "0x020d000000000000"
C_INCLUDES = [os.path.normpath(os.path.join(CSRC, d)) for d in BUILD_MK["COMERA_C_INCLUDES"]]


def _default_cuda_home():
    """Sets CUDA_HOME when torch would guess it wrong: torch takes the folder
    above `which nvcc`, which for a wrapper script such as /usr/local/bin/nvcc
    has no CUDA headers."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc and os.path.exists(os.path.join(os.path.dirname(nvcc), "..", "include",
                                            "cuda_runtime_api.h")):
        return
    for home in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(home, "bin", "nvcc")):
            os.environ["CUDA_HOME"] = home
            return


def _cxx_standard():
    """C++20 where torch's headers demand it (torch >= 2.14), else C++17."""
    from torch.utils import cpp_extension

    for inc in cpp_extension.include_paths():
        aten = os.path.join(inc, "ATen", "ATen.h")
        if os.path.exists(aten):
            with open(aten) as f:
                return "-std=c++20" if "202002L" in f.read(4096) else "-std=c++17"
    return "-std=c++17"


def _cuda_choice():
    """(build comera._C_cuda?, why) from COMERA_CUDA, torch and nvcc."""
    import torch
    from torch.utils import cpp_extension

    want = os.environ.get("COMERA_CUDA", "auto").strip().lower()
    if want not in ("auto", "nvcc", "0", "1"):
        sys.exit(f"COMERA_CUDA must be auto, nvcc, 0 or 1, got {want!r}")
    if want == "0":
        return False, "off (COMERA_CUDA=0)"
    if want == "auto" and torch.version.cuda is None:
        return False, "off (auto: torch has no CUDA; COMERA_CUDA=nvcc builds it anyway)"
    if cpp_extension.CUDA_HOME is None:
        # a CPU build of torch leaves CUDA_HOME unset; nvcc and the stable
        # headers are all comera._C_cuda needs, so look for the toolkit the
        # way torch does (CUDA_HOME, CUDA_PATH, the folder above nvcc)
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        nvcc_path = shutil.which("nvcc")
        if home is None and nvcc_path is not None:
            home = os.path.dirname(os.path.dirname(nvcc_path))
        cpp_extension.CUDA_HOME = home
    home = cpp_extension.CUDA_HOME
    if home is None or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        if want == "1":
            sys.exit("COMERA_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        return False, f"off ({want}: nvcc not found)"
    return True, f"on (COMERA_CUDA={want})"


def _site_dirs():
    import site
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return [d for d in dirs + sys.path if d and os.path.isdir(d)]


def _cublas_build_args(build_dir):
    """Include folders and link arguments for cuBLAS.

    The CUDA toolkit may lack cuBLAS while torch's pip wheels carry it
    (nvidia/cu13 or nvidia/cublas in site-packages, headers and a versioned
    libcublas.so.N with no unversioned link; COMERA_CUBLAS_INCLUDE names
    such a folder's include/ for a Python without them): then the headers
    that the toolkit lacks are copied into the build folder (so none shadows
    one of the toolkit's) and the library is linked by its full path, which
    records only its soname (no folder of this machine)."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME or "/usr/local/cuda"
    found_inc = os.path.exists(os.path.join(home, "include", "cublas_v2.h"))
    args = {"include_dirs": [], "extra_link_args": []}
    wheel_dirs = [os.path.join(d, "nvidia", sub) for d in _site_dirs() for sub in ("cu13", "cublas")]
    if os.environ.get("COMERA_CUBLAS_INCLUDE"):
        wheel_dirs.insert(0, os.path.dirname(os.path.abspath(os.environ["COMERA_CUBLAS_INCLUDE"])))
    if not found_inc:
        # torch's CUDA headers also want cusparse.h, cusolver*.h, ...: copy
        # every header of the wheel that the toolkit lacks, and only those
        for w in wheel_dirs:
            src = os.path.join(w, "include")
            if not os.path.exists(os.path.join(src, "cublas_v2.h")):
                continue
            inc = os.path.join(build_dir, "cuda-extra-include")
            for dirpath, _, files in os.walk(src):
                rel = os.path.relpath(dirpath, src)
                for name in files:
                    if not os.path.exists(os.path.join(home, "include", rel, name)):
                        os.makedirs(os.path.join(inc, rel), exist_ok=True)
                        shutil.copy(os.path.join(dirpath, name), os.path.join(inc, rel, name))
            args["include_dirs"].append(inc)
            break
        else:
            print("comera: warning: cublas_v2.h not found in the CUDA toolkit or site-packages")
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        if os.path.exists(os.path.join(home, sub, "libcublas.so")):
            args["extra_link_args"] += ["-L" + os.path.join(home, sub), "-lcublas"]
            return args
    for w in wheel_dirs:
        libs = sorted(glob.glob(os.path.join(w, "lib", "libcublas.so.*")))
        if libs:
            args["extra_link_args"].append(libs[0])
            return args
    args["extra_link_args"].append("-lcublas")  # let the linker say what is missing
    return args


def _build_c_library(build_temp):
    """Compiles the C kernels (csrc/build.mk) with the C compiler into libcomera_cpu.a."""
    cc = os.environ.get("CC", "cc")
    obj_dir = os.path.join(build_temp, "comera_c")
    os.makedirs(obj_dir, exist_ok=True)
    objects = []
    for rel in BUILD_MK["COMERA_C_SOURCES"]:
        src = os.path.join(CSRC, rel)
        obj = os.path.join(obj_dir, rel[:-2].replace("/", "_") + ".o")  # tt_linear_cpu.o
        includes = [f"-I{d}" for d in C_INCLUDES]
        cmd = [cc, *C_FLAGS, *includes, "-c", src, "-o", obj]
        print(" ".join(cmd))
        subprocess.check_call(cmd)
        objects.append(obj)
    lib = os.path.join(obj_dir, "libcomera_cpu.a")
    if os.path.exists(lib):
        os.remove(lib)
    subprocess.check_call(["ar", "rcs", lib, *objects])
    return lib


# Where comera._C_cuda finds libcudart and libcublas when torch has not
# loaded them already (torch's CUDA build loads both on import, and the
# dynamic linker then matches them by soname): the nvidia-* wheels beside
# the comera package in site-packages (CUDA 13: nvidia/cu13/lib; CUDA 12:
# one folder per library).  Nothing of CUDA's is in the wheel itself.
CUDA_RUNPATH = ":".join("$ORIGIN/../nvidia/" + d + "/lib" for d in ("cu13", "cublas", "cuda_runtime"))


def _compile_flags():
    """C++ flags shared by both modules, and the define for the glue."""
    import torch

    # __FILE__ (in the stable ABI's error messages) and debug info without the
    # build machine's folders: csrc/..., torch/include/..., include/python3.x
    site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    prefix_map = [f"-ffile-prefix-map={d}/=" for d in (ROOT, site, sys.base_prefix)]
    # glibc >= 2.32's __libc_single_threaded, renamed to a local variable
    # (csrc/common/manylinux.cpp: keeps the modules in manylinux_2_28)
    compat = ["-D__libc_single_threaded=comera_libc_single_threaded"]
    return ["-O3", _cxx_standard(), "-Wall"] + prefix_map + compat, compat


def _extensions(with_cuda):
    """comera._C, and comera._C_cuda when with_cuda (see the module docstring)."""
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cxx_flags, compat = _compile_flags()
    glue = sorted(glob.glob(os.path.join("csrc", "*", "op.cpp")))
    common = [os.path.join("csrc", "common", "manylinux.cpp")]
    # the glue is on the LibTorch stable ABI: this is the oldest torch the
    # built library loads into (pyproject.toml states the same minimum)
    macros = [("TORCH_TARGET_VERSION", TORCH_TARGET_VERSION)]
    # only PyInit_* is exported (csrc/exports.map); --as-needed drops
    # libraries nothing uses
    link = ["-fopenmp", "-Wl,--as-needed", "-Wl,--version-script=" + os.path.join(CSRC, "exports.map")]
    exts = [CppExtension("comera._C", [os.path.join("csrc", "registration.cpp")] + glue + common,
                         include_dirs=C_INCLUDES, define_macros=macros,
                         extra_compile_args={"cxx": cxx_flags}, extra_link_args=link)]
    if with_cuda:
        cublas = _cublas_build_args(os.path.join(ROOT, "build"))
        cu = sorted(glob.glob(os.path.join("csrc", "*", "*.cu")))
        exts.append(CUDAExtension(
            "comera._C_cuda", [os.path.join("csrc", "cuda_module.cpp")] + glue + common + cu,
            include_dirs=C_INCLUDES + cublas["include_dirs"],
            define_macros=macros + [("COMERA_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"] + compat},
            extra_link_args=link + cublas["extra_link_args"] + ["-Wl,-rpath," + CUDA_RUNPATH],
        ))
    # The stable ABI needs only libtorch's C shims (libtorch_cpu): no c10,
    # libtorch_python (PyInit_* is plain CPython) or torch's CUDA libraries.
    version_bound = {"c10", "torch", "torch_python", "c10_cuda", "torch_cuda"}
    for ext in exts:
        ext.libraries = [lib for lib in ext.libraries if lib not in version_bound]
    return exts


def main():
    _default_cuda_home()  # before torch.utils.cpp_extension reads CUDA_HOME
    from torch.utils.cpp_extension import BuildExtension

    with_cuda, why = _cuda_choice()
    if with_cuda and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        # sm_80 (A100), sm_90 (H100), sm_100 (B200; nvcc >= 12.8, CUDA 13 has it)
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0;10.0"
    print(f"comera build configuration: CUDA module {why}; C kernels: C11 -O3 OpenMP; "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset)')}")

    class BuildWithC(BuildExtension):
        def build_extensions(self):
            lib = _build_c_library(self.build_temp)
            for ext in self.extensions:
                ext.extra_objects = [lib] + list(ext.extra_objects or [])
            super().build_extensions()

        def build_extension(self, ext):
            # one object folder per module: both compile csrc/<op>/op.cpp,
            # with and without COMERA_WITH_CUDA
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

    setup(ext_modules=_extensions(with_cuda), cmdclass={"build_ext": BuildWithC})


if __name__ == "__main__":
    main()
