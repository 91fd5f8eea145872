# The one source of the C kernels' compile settings.  Included by the test
# Makefiles (tests/c, tests/fuzz, tests/cuda_emu) and read by setup.py
# (a reader of `NAME = value` lines): keep to that plain form, no make
# functions.  Paths are relative to this folder (csrc).  Each user adds its
# own optimisation and sanitizer flags on top.
COMERA_C_STD = -std=c11
COMERA_C_WARN = -Wall -Wextra
COMERA_C_OPENMP = -fopenmp
# the C kernels: compiled with the C compiler into the extension's static library
COMERA_C_SOURCES = common/gemm.c common/gemm_f64.c common/gemm_isa.c common/gemm_avx2.c common/gemm_dot.c \
                   common/gemm_half.c common/gemm_amx.c common/status.c common/pages.c \
                   common/gemm_hnarrow.c common/workspace.c common/outpool.c \
                   tt_linear/plan.c tt_linear/cpu_f32.c tt_linear/cpu_f64.c tt_linear/cpu_half.c \
                   tt_embedding/plan.c tt_embedding/cpu_f32.c tt_embedding/cpu_f64.c \
                   gate_prox/cpu_f32.c gate_prox/cpu_f64.c
# include folders: the public C ABI (comera/*.h) and csrc itself (<op>/*.h, common/*.h)
COMERA_C_INCLUDES = include .
