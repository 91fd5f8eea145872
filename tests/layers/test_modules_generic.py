"""PyTorch's generic module tests over comera's layers.

PyTorch checks every ``torch.nn`` module with one set of generic tests,
class ``TestModule`` of its ``test/test_modules.py``, run over the
``ModuleInfo`` entries of ``torch.testing._internal.common_modules``.  This
file runs the same checks, in a class of the same name, over comera's
entries (tests/comera_module_db.py), with the machinery torch ships in
``torch.testing._internal``: ``@modules`` generates one test per entry,
dtype and training mode, ``instantiate_device_type_tests`` one class per
device (``TestModuleCPU``, and ``TestModuleCUDA`` where a GPU is present),
and the decorators of an entry (its skips, each with its reason) apply by
test name as they do in PyTorch.

The checks, as PyTorch's tests define them for torch 2.13:

- ``test_forward``: the output equals the entry's reference; ``.float()`` /
  ``.double()`` keep every parameter on the device in the dtype;
- ``test_factory_kwargs``: ``device=`` / ``dtype=`` reach every parameter and
  buffer the constructor creates;
- ``test_multiple_device_transfer``, ``test_cpu_gpu_parity`` (CUDA only);
- ``test_repr``, ``test_pickle`` (``torch.save`` / ``torch.load`` of the
  whole module gives the same output);
- ``test_non_contiguous_tensors``: outputs and all gradients the same for
  non-contiguous inputs and output gradients;
- ``test_grad``, ``test_gradgrad`` (float64): ``gradcheck`` /
  ``gradgradcheck`` with torch's test defaults (batched gradients checked),
  over the inputs and every parameter together, then one at a time;
- ``test_memory_format``; ``test_if_train_and_eval_modes_differ``;
- ``test_device_ctx_init``: built under ``torch.device("meta")``, the
  parameters have the metadata of a CPU-built layer;
- ``test_errors``: the entry's error inputs raise what they name;
- ``test_to``, ``test_to_empty``: ``Module.to`` / ``to_empty`` with and
  without ``torch.__future__.set_swap_module_params_on_conversion``.

Importing ``torch.testing._internal.common_utils`` has two side effects on
the whole pytest process: it freezes the ``torch.backends`` flags (PyTorch's
own suite sets them only through context managers) and loads a hypothesis
profile of its own.  This module undoes both right after the import, since
other comera tests set those flags directly and choose their own hypothesis
settings.  It needs the ``expecttest`` package (the ``test`` extra).
"""
import io
from copy import deepcopy
from itertools import chain, product

import hypothesis
import torch

_PROFILE = hypothesis.settings.get_current_profile_name()
import torch.testing._internal.common_utils  # noqa: E402,F401  (side effects: see the module doc)
hypothesis.settings.load_profile(_PROFILE)
# torch.backends.disable_global_flags() undone (the module object is a wrapper:
# the flag lives in its functions' globals)
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

from torch._subclasses.meta_utils import assert_metadata_eq  # noqa: E402
from torch.testing._internal.common_device_type import (  # noqa: E402
    instantiate_device_type_tests, onlyCPU, onlyCUDA)
from torch.testing._internal.common_modules import (  # noqa: E402
    ModuleErrorEnum, TrainEvalMode, modules)
from torch.testing._internal.common_utils import (  # noqa: E402
    TestCase, freeze_rng_state, get_tensors_from, gradcheck, gradgradcheck, mock_wrapper,
    parametrize, wrapSwapTensorsTest)
from unittest.mock import patch  # noqa: E402

from comera_module_db import comera_module_db  # noqa: E402

_flatten = torch.utils._pytree.tree_flatten
_unflatten = torch.utils._pytree.tree_unflatten


def _map_tensors(obj, fn):
    """``obj`` (tuples, lists, dicts, generators of tensors) with ``fn``
    applied to every tensor; other leaves are returned as they are."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if hasattr(obj, "__next__"):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    return obj


def _retain_grads(obj):
    def keep(t):
        if t.requires_grad:
            t.retain_grad()
    _map_tensors(obj, keep)


def _grads(obj):
    return _map_tensors(obj, lambda t: t.grad if t.requires_grad else None)


def _clear_grads(obj):
    def clear(t):
        t.grad = None
    _map_tensors(obj, clear)


def _backward_all(output, grad_output):
    """Backward from every output that requires grad, keeping the graph."""
    outs, _ = _flatten(output)
    grads, _ = _flatten(grad_output)
    for o, g in zip(outs, grads):
        if isinstance(o, torch.Tensor) and o.requires_grad:
            o.backward(g, retain_graph=True)


def _build(module_info, module_input, device, dtype, training):
    args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
    m = module_info.module_cls(*args, **kwargs)
    m.to(device).to(dtype)
    m.train(training)
    return m


def _forward(m, module_input):
    return m(*module_input.forward_input.args, **module_input.forward_input.kwargs)


class TestModule(TestCase):
    _do_cuda_memory_leak_check = True
    _do_cuda_non_default_stream = True
    precision = 1e-5
    rel_tol = 1e-5

    def _assert_on(self, module, device, dtype):
        """Every parameter and buffer on ``device``; floating ones in ``dtype``."""
        device = torch.device(device)
        for kind, items in (("parameter", module.named_parameters()),
                            ("buffer", module.named_buffers())):
            for name, t in items:
                self.assertEqual(t.device, device, f"{kind} {name} is on {t.device}, not {device}")
                if t.dtype.is_floating_point:
                    self.assertEqual(t.dtype, dtype, f"{kind} {name} is {t.dtype}, not {dtype}")

    def _inputs(self, module_info, device, dtype, training, requires_grad=False):
        return module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                              requires_grad=requires_grad, training=training)

    @modules(comera_module_db)
    def test_forward(self, device, dtype, module_info, training):
        convert = {torch.float32: torch.nn.Module.float, torch.float64: torch.nn.Module.double}
        for module_input in self._inputs(module_info, device, dtype, training):
            if module_input.forward_input is None:
                continue
            with freeze_rng_state():
                m = _build(module_info, module_input, device, dtype, training)
                out = _forward(m, module_input)
                if module_input.reference_fn is not None:
                    ref = module_input.reference_fn(m, *module_input.forward_input.args,
                                                    **module_input.forward_input.kwargs)
                    self.assertEqual(out, ref)
                if dtype in convert:
                    convert[dtype](m)
                    _forward(m, module_input)
                    self._assert_on(m, device, dtype)

    @modules(comera_module_db)
    def test_factory_kwargs(self, device, dtype, module_info, training):
        for module_input in self._inputs(module_info, device, dtype, training):
            args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
            # Does the constructor make parameters or buffers of its own (from
            # tensors it was not given)?  The mocks pass every call through.
            new_param = mock_wrapper(torch.nn.Parameter.__new__)
            new_buffer = mock_wrapper(torch.nn.Module.register_buffer)
            with patch.object(torch.nn.Parameter, "__new__", new_param), \
                    patch.object(torch.nn.Module, "register_buffer", new_buffer):
                module_info.module_cls(*args, **kwargs).train(training)
            given = get_tensors_from(args, kwargs)
            creates = any(
                get_tensors_from(call_args, call_kwargs)
                and not given.intersection(get_tensors_from(call_args, call_kwargs))
                for mock in (new_param.mock, new_buffer.mock)
                for call_args, call_kwargs in mock.call_args_list)
            if not creates:
                continue
            m = module_info.module_cls(*args, **dict(kwargs, device=device, dtype=dtype))
            m.train(training)
            self._assert_on(m, device, dtype)

    @onlyCUDA
    @modules(comera_module_db)
    def test_multiple_device_transfer(self, device, dtype, module_info, training):
        on_device = self._inputs(module_info, device, dtype, training)
        on_cpu = self._inputs(module_info, "cpu", dtype, training)
        for dev_input, cpu_input in zip(on_device, on_cpu):
            if dev_input.forward_input is None:
                continue
            with freeze_rng_state():
                m = _build(module_info, dev_input, device, dtype, training)
                _forward(m, dev_input)
                self._assert_on(m, device, dtype)
                m.cpu()
                _forward(m, cpu_input)
                self._assert_on(m, "cpu", dtype)
                m.cuda()
                _forward(m, dev_input)
                self._assert_on(m, device, dtype)
                if torch.cuda.device_count() >= 2:
                    to1 = _map_tensors((dev_input.forward_input.args,
                                        dev_input.forward_input.kwargs), lambda t: t.cuda(1))
                    m.cuda(1)
                    with torch.cuda.device(1):
                        m(*to1[0], **to1[1])
                    self._assert_on(m, torch.device("cuda:1"), dtype)

    @modules(comera_module_db)
    def test_repr(self, device, dtype, module_info, training):
        for module_input in self._inputs(module_info, device, dtype, training):
            m = _build(module_info, module_input, device, dtype, training)
            repr(m)
            str(m)

    @modules(comera_module_db)
    def test_pickle(self, device, dtype, module_info, training):
        for module_input in self._inputs(module_info, device, dtype, training):
            if module_input.forward_input is None:
                continue
            with freeze_rng_state():
                m = _build(module_info, module_input, device, dtype, training)
                out = _forward(m, module_input)
                buf = io.BytesIO()
                torch.save(m, buf)
                buf.seek(0)
                copy = torch.load(buf, weights_only=False)  # a whole module, not weights
                self.assertEqual(out, _forward(copy, module_input))

    @modules(comera_module_db)
    def test_non_contiguous_tensors(self, device, dtype, module_info, training):
        def strided(obj):
            def one(t):
                if t.dim() == 0:
                    return t  # a scalar cannot be non-contiguous
                out = torch.repeat_interleave(t, 2, dim=-1)[..., ::2].detach()
                out.requires_grad = t.requires_grad
                return out
            return _map_tensors(obj, one)

        def any_strided(obj):
            return any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in _flatten(obj)[0])

        for module_input in self._inputs(module_info, device, dtype, training, requires_grad=True):
            if module_input.forward_input is None:
                continue
            args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
            if not any_strided((args, kwargs)):
                continue
            m = _build(module_info, module_input, device, dtype, training)
            _retain_grads((args, kwargs))
            with freeze_rng_state():
                out0 = m(*args, **kwargs)
                grad_out = _map_tensors(out0, lambda o: o.clone().detach_().normal_()
                                        if o.requires_grad else None)
                _backward_all(out0, grad_out)
            in_grads0 = deepcopy(_grads((args, kwargs)))
            param_grads0 = deepcopy([p.grad for p in m.parameters()])
            variants = [(args, kwargs), strided((args, kwargs))]
            for (a, kw), g in product(variants, [grad_out, strided(grad_out)]):
                g = deepcopy(g)
                _clear_grads((a, kw))
                _clear_grads(list(m.parameters()))
                with freeze_rng_state():
                    out = m(*a, **kw)
                    _backward_all(out, g)
                self.assertEqual(out, out0)
                self.assertEqual(_grads(a), in_grads0[0], atol=1e-4, rtol=0)
                self.assertEqual(_grads(kw), in_grads0[1], atol=1e-4, rtol=0)
                self.assertEqual([p.grad for p in m.parameters()], param_grads0)

    def _check_gradients(self, device, dtype, module_info, training, check):
        for module_input in self._inputs(module_info, device, dtype, training, requires_grad=True):
            if module_input.forward_input is None:
                continue
            m = _build(module_info, module_input, device, dtype, training)
            params = tuple(m.parameters())
            args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
            tensor_kwargs = [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
            other_kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
            spec = None

            def fn(*flat):
                every = _unflatten(flat, spec)
                new_args = every[:len(args)]
                new_kwargs = {k: v for (k, _), v in
                              zip(tensor_kwargs, every[len(every) - len(tensor_kwargs):])}
                with freeze_rng_state():
                    return _flatten(m(*new_args, **new_kwargs, **other_kwargs))[0]

            def run():
                nonlocal spec
                flat, spec = _flatten(args + params + tuple(v for _, v in tensor_kwargs))
                self.assertTrue(check(fn, flat, nondet_tol=0.0))

            run()  # the total derivative
            # then each parameter and each tensor keyword argument on its own
            wanted = [(t, t.requires_grad) for t in params + tuple(v for _, v in tensor_kwargs)]
            for t, _ in wanted:
                t.requires_grad = False
            for t, old in wanted:
                t.requires_grad = old
                run()
                t.requires_grad = False

    @modules(comera_module_db, allowed_dtypes=[torch.double])
    def test_grad(self, device, dtype, module_info, training):
        self._check_gradients(device, dtype, module_info, training, gradcheck)

    @modules([m for m in comera_module_db if m.supports_gradgrad], allowed_dtypes=[torch.double])
    def test_gradgrad(self, device, dtype, module_info, training):
        self._check_gradients(device, dtype, module_info, training, gradgradcheck)

    @onlyCUDA
    @modules(comera_module_db)
    def test_cpu_gpu_parity(self, device, dtype, module_info, training):
        def moved(obj):
            def one(t):
                out = t.detach().to(device=device)
                out.requires_grad = t.requires_grad
                return out
            return _map_tensors(obj, one)

        for module_input in self._inputs(module_info, "cpu", dtype, training, requires_grad=True):
            cpu_args, cpu_kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
            dev_args, dev_kwargs = moved((cpu_args, cpu_kwargs))
            _retain_grads((cpu_args, cpu_kwargs, dev_args, dev_kwargs))
            c_args, c_kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
            cpu_m = module_info.module_cls(*c_args, **c_kwargs).to(dtype).to("cpu").train(training)
            dev_m = module_info.module_cls(*c_args, **c_kwargs).to(dtype).to(device).train(training)
            for a, b in zip(cpu_m.parameters(), dev_m.parameters()):
                b.data.copy_(a)
            cpu_out = cpu_m(*cpu_args, **cpu_kwargs)
            dev_out = dev_m(*dev_args, **dev_kwargs)
            self.assertEqual(cpu_out, dev_out, atol=5e-2 if dtype == torch.float32 else 4e-4,
                             rtol=0)
            for c, d in zip(_flatten(cpu_out)[0], _flatten(dev_out)[0]):
                if not c.requires_grad:
                    continue
                for _ in range(5):
                    g = c.clone().normal_()
                    c.backward(g, retain_graph=True)
                    d.backward(g.type_as(d), retain_graph=True)
                    self.assertEqual(_grads(cpu_args), _grads(dev_args))
                    self.assertEqual(_grads(cpu_kwargs), _grads(dev_kwargs))
                    for a, b in zip(cpu_m.parameters(), dev_m.parameters()):
                        self.assertEqual(a.grad, b.grad)

    @modules(comera_module_db)
    def test_memory_format(self, device, dtype, module_info, training):
        def has_dim(obj, n):
            return any(isinstance(t, torch.Tensor) and t.dim() == n for t in _flatten(obj)[0])

        def in_format(fmt, obj):
            def one(t):
                ok = (fmt == torch.channels_last and t.dim() == 4) or \
                    (fmt == torch.channels_last_3d and t.dim() == 5) or \
                    fmt in (torch.contiguous_format, torch.preserve_format)
                out = t.clone().to(memory_format=fmt) if ok else t.clone()
                return out.detach().requires_grad_(t.requires_grad)
            return _map_tensors(obj, one)

        def check_format(outputs, input_fmt, module_fmt):
            affects = module_info.module_memformat_affects_out

            def one(t):
                if t.dim() == 4 and (input_fmt == torch.channels_last
                                     or (module_fmt == torch.channels_last and affects)):
                    self.assertTrue(t.is_contiguous(memory_format=torch.channels_last))
                elif t.dim() == 5 and (input_fmt == torch.channels_last_3d
                                       or (module_fmt == torch.channels_last_3d and affects)):
                    self.assertTrue(t.is_contiguous(memory_format=torch.channels_last_3d))
                else:
                    self.assertTrue(t.is_contiguous())
            _map_tensors(outputs, one)

        def diff(ts):
            return tuple(t for t in _flatten(ts)[0] if isinstance(t, torch.Tensor) and t.requires_grad)

        for module_input in self._inputs(module_info, device, dtype, training, requires_grad=True):
            if module_input.forward_input is None:
                continue
            fwd = module_input.forward_input
            input_fmts = [torch.contiguous_format]
            module_fmts = [torch.preserve_format, torch.contiguous_format]
            for n, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
                if has_dim(fwd.args, n):
                    input_fmts.append(fmt)
                    module_fmts.append(fmt)
            with freeze_rng_state():
                m = _build(module_info, module_input, device, dtype, training)
                want = m(*fwd.args, **fwd.kwargs)
                outs = diff(want)
                if training and outs:
                    ins = diff((fwd.args, fwd.kwargs, tuple(m.parameters())))
                    ref_gouts = tuple(torch.rand_like(t) for t in outs)
                    ref_gins = torch.autograd.grad(outs, ins, grad_outputs=ref_gouts)
                for input_fmt in input_fmts:
                    a, kw = in_format(input_fmt, (fwd.args, fwd.kwargs))
                    for module_fmt in module_fmts:
                        m.to(memory_format=module_fmt)
                        got = m(*a, **kw)
                        changed = input_fmt != torch.contiguous_format or \
                            module_fmt != torch.contiguous_format
                        if changed:
                            self.assertEqual(got, want)
                        check_format(got, input_fmt, module_fmt)
                        gouts = diff(got)
                        if training and gouts:
                            gins = torch.autograd.grad(
                                gouts, diff((a, kw, tuple(m.parameters()))),
                                grad_outputs=tuple(torch.empty_like(t).copy_(r)
                                                   for t, r in zip(gouts, ref_gouts)))
                            if changed:
                                self.assertEqual(gins, ref_gins)
                            check_format(gins, input_fmt, module_fmt)

    @modules(comera_module_db, train_eval_mode=TrainEvalMode.train_only)
    def test_if_train_and_eval_modes_differ(self, device, dtype, module_info, training):
        for module_input in self._inputs(module_info, device, dtype, training):
            if module_input.forward_input is None:
                continue
            m = _build(module_info, module_input, device, dtype, training)
            delattr(m, "training")  # a forward that reads it fails now
            try:
                _forward(m, module_input)
            except AttributeError as e:
                if "'training'" not in str(e):
                    raise
                self.assertTrue(module_info.train_and_eval_differ,
                                f"{module_info.name}: the training mode affects the forward, but "
                                "its ModuleInfo says train_and_eval_differ=False")

    @onlyCPU
    @modules(comera_module_db)
    def test_device_ctx_init(self, device, dtype, module_info, training):
        cpu_inputs = self._inputs(module_info, device, dtype, training)
        with torch.device("meta"):
            meta_inputs = module_info.module_inputs_func(module_info, device=None, dtype=dtype,
                                                         requires_grad=False, training=training)
        for cpu_input, meta_input in zip(cpu_inputs, meta_inputs):
            c = cpu_input.constructor_input
            m_cpu = module_info.module_cls(*c.args, **c.kwargs)
            c = meta_input.constructor_input
            with torch.device("meta"):
                m_meta = module_info.module_cls(*c.args, **c.kwargs)
            for meta, cpu in chain(zip(m_meta.parameters(), m_cpu.parameters()),
                                   zip(m_meta.buffers(), m_cpu.buffers())):
                if torch.nn.parameter.is_lazy(meta):
                    continue
                self.assertTrue(meta.is_meta)
                assert_metadata_eq(self.assertEqual, meta, cpu)

    @modules([m for m in comera_module_db if m.module_error_inputs_func is not None])
    def test_errors(self, device, dtype, module_info, training):
        for error_input in module_info.module_error_inputs_func(
                module_info, device=device, dtype=dtype, requires_grad=False, training=training):
            module_input = error_input.module_error_input
            c = module_input.constructor_input
            if error_input.error_on == ModuleErrorEnum.CONSTRUCTION_ERROR:
                with self.assertRaisesRegex(error_input.error_type, error_input.error_regex):
                    module_info.module_cls(*c.args, **c.kwargs)
            elif error_input.error_on == ModuleErrorEnum.FORWARD_ERROR:
                m = module_info.module_cls(*c.args, **c.kwargs)
                with self.assertRaisesRegex(error_input.error_type, error_input.error_regex):
                    _forward(m, module_input)
            else:
                raise NotImplementedError(f"unknown error kind {error_input.error_on}")

    @modules([m for m in comera_module_db if not m.is_lazy], allowed_dtypes=[torch.float32])
    @parametrize("swap", [True, False])
    @parametrize("set_grad", [True, False])
    @wrapSwapTensorsTest()
    def test_to(self, device, dtype, module_info, training, swap, set_grad):
        torch.__future__.set_swap_module_params_on_conversion(swap)
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for module_input in self._inputs(module_info, device, dtype, training):
            c = module_input.constructor_input
            m = module_info.module_cls(*c.args, **c.kwargs)

            def place(mod):
                # parameters moved one by one (Module.to is what is tested)
                for child in mod.children():
                    place(child)
                for name, p in list(mod.named_parameters(recurse=False)):
                    new = torch.nn.Parameter(p.detach().clone().to(device, dtype))
                    setattr(mod, name, new)
                    if set_grad:
                        new.grad = torch.randn_like(new)
                for name, b in list(mod.named_buffers(recurse=False)):
                    setattr(mod, name, b.detach().clone().to(device, dtype))
            place(m)
            params = lambda: list(m.parameters())  # noqa: E731
            if swap and not set_grad and params():
                # .to() after a forward and backward (swap_tensors needs the
                # autograd graph that saw the parameters to be gone)
                out = _forward(m, module_input)
                _flatten(out)[0][0].sum().backward()
                m.to(dtype=torch.half)
                m.to(dtype=torch.float32)
            prev = (device, dtype)
            for device_, dtype_ in product(devices, module_info.dtypes):
                same = (device_, dtype_) == prev
                prev = (device_, dtype_)
                ids0 = [id(p) for p in params()]
                cdata0 = [p._cdata for p in params()]
                if set_grad:
                    gids0 = [id(p.grad) for p in params()]
                    gcdata0 = [p.grad._cdata for p in params()]
                m.to(device=device_, dtype=dtype_)
                self.assertTrue(all(isinstance(p, torch.nn.Parameter) for p in params()))
                self.assertTrue(all(p.device.type == device_ for p in params()))
                self.assertTrue(all(p.dtype == dtype_ for p in params()))
                ids1 = [id(p) for p in params()]
                cdata1 = [p._cdata for p in params()]
                if set_grad:
                    self.assertTrue(all(p.grad.device.type == device_ for p in params()))
                    self.assertTrue(all(p.grad.dtype == dtype_ for p in params()))
                    gids1 = [id(p.grad) for p in params()]
                    gcdata1 = [p.grad._cdata for p in params()]
                self.assertEqual(ids0, ids1)  # the same Parameter objects
                if swap:
                    # swap_tensors: same Python objects, new C++ tensors
                    self.assertTrue(all(a != b for a, b in zip(cdata0, cdata1)))
                    if set_grad:
                        self.assertEqual(gids0, gids1)
                        if not same:
                            self.assertTrue(all(a != b for a, b in zip(gcdata0, gcdata1)))
                else:
                    # .data assignment: same C++ tensors
                    self.assertEqual(cdata0, cdata1)
                    if set_grad:
                        self.assertEqual(gcdata0, gcdata1)

    @modules([m for m in comera_module_db if not m.is_lazy], allowed_dtypes=[torch.float32])
    @parametrize("swap", [True, False])
    @wrapSwapTensorsTest()
    def test_to_empty(self, device, dtype, module_info, swap, training):
        with torch.device("meta"):
            inputs = module_info.module_inputs_func(module_info, device=None, dtype=dtype,
                                                    requires_grad=False, training=training)
        torch.__future__.set_swap_module_params_on_conversion(swap)
        dev = torch.device(device)
        for module_input in inputs:
            c = module_input.constructor_input
            with torch.device("meta"):
                m = module_info.module_cls(*c.args, **c.kwargs)
            ids0 = [id(p) for p in m.parameters()]
            cdata0 = [p._cdata for p in m.parameters()]
            m.to_empty(device=dev)
            self.assertTrue(all(isinstance(p, torch.nn.Parameter) for p in m.parameters()))
            self.assertTrue(all(p.device == dev for p in m.parameters()))
            self.assertTrue(all(p.dtype == dtype for p in m.parameters()))
            ids1 = [id(p) for p in m.parameters()]
            cdata1 = [p._cdata for p in m.parameters()]
            if swap:
                self.assertEqual(ids0, ids1)  # swapped in place
            else:
                self.assertTrue(all(a != b for a, b in zip(ids0, ids1)))  # new Parameters
            self.assertTrue(all(a != b for a, b in zip(cdata0, cdata1)))


instantiate_device_type_tests(TestModule, globals())


def test_importing_torch_test_machinery_left_the_process_as_it_was():
    """The two side effects of importing common_utils are undone (module doc)."""
    assert not torch.backends.flags_frozen()
    assert hypothesis.settings.get_current_profile_name() == _PROFILE
