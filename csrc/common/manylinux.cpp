// What keeps the extension modules inside the manylinux_2_28 platform tag
// (the policy of torch's own wheels: glibc 2.28, libstdc++ of GCC 8) when
// they are built with a newer GCC and glibc.  Three references that newer
// headers emit on their own would otherwise bind to newer symbol versions:
//  - std::__throw_bad_array_new_length (GLIBCXX_3.4.29, GCC 11), called by
//    std::allocator on an impossible size: defined here;
//  - the default constructors of std::ostringstream and std::stringstream
//    (GLIBCXX_3.4.26, GCC 9; the glue's and the stable headers' messages):
//    instantiated here from the header's inline definitions;
//  - glibc's __libc_single_threaded (GLIBC_2.32), read by libstdc++'s
//    reference counting (shared_ptr, inside every torch::stable::Tensor):
//    setup.py renames it to comera_libc_single_threaded, defined here as 0
//    ("other threads may exist"), so the atomic path is always taken, as it
//    is anyway in a torch process (`import torch` starts threads; measured).
// The exports map (csrc/exports.map) keeps all of these local to each
// module, so the dynamic linker never sees them.  (pthread_once, the fourth,
// is avoided in common/gemm_isa.c and common/outpool.c.)
#include <new>
#include <sstream>

#if defined(__GLIBCXX__) && _GLIBCXX_USE_CXX11_ABI
#if _GLIBCXX_RELEASE >= 11
// weak: a GCC that links libstdc++ statically (as some CUDA images' do)
// brings its own definition, which then wins instead of clashing
namespace std {
[[noreturn]] __attribute__((weak)) void __throw_bad_array_new_length() {
    throw bad_array_new_length();
}
}  // namespace std
#endif
#if _GLIBCXX_RELEASE >= 9
template std::ostringstream::basic_ostringstream();
template std::stringstream::basic_stringstream();
#endif
#endif

extern "C" {
char comera_libc_single_threaded = 0;
}
