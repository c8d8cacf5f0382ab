"""bench.gateway_profile_check's own logic (the check itself needs the GPU host and ncu): what it
demands of each job, and the kernel it names for the deep profile."""

from __future__ import annotations

import re

from bench.gateway_profile_check import function_name, verdicts

SOL_TOP = (
    "void elementwise_kernel<128, 2, void gpu_kernel_impl_nocast<BinaryFunctor<float, float, float, "
    "binary_internal::MulFunctor<float>>>(TensorIteratorBase &, const T1 &)::[lambda(int) (instance 1)]>"
    "(int, T3)"
)


def test_the_deep_profile_names_the_top_kernels_function_as_a_regex_that_finds_it() -> None:
    assert function_name(SOL_TOP) == "elementwise_kernel"
    assert function_name("void at::native::reduce_kernel<512, 1>(R)") == "at::native::reduce_kernel"
    assert function_name("ampere_sgemm_128x64_nn") == "ampere_sgemm_128x64_nn"
    assert re.search(re.escape(function_name(SOL_TOP)), SOL_TOP)


def test_a_deep_profile_without_kernels_fails_the_check() -> None:
    ok = {"summary": {"status": "succeeded", "kernels": [{"name": "k", "duration": 1.0}]}}
    empty = {"summary": {"status": "succeeded", "kernels": [], "note": "no kernels captured by ncu"}}
    v = verdicts({"profile-deep": empty, "profile-sol": ok})
    assert v["profile-sol"][0] and not v["profile-deep"][0], v
