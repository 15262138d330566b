"""What a repeated call sees again: the caches that make a second call cheap (launch tables per
BlockMask, the transposed lists, traced mods keyed by what their code reads) against changes the
user makes between calls, each call compared with the float64 reference."""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import BlockMask, create_block_mask
from flexattn.reference import attention_reference

S, D = 150, 16  # (not a multiple of the 32-row blocks)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 1, S, D, generator=g) for _ in range(3))


def assert_matches_reference(qkv, **kw):
    got = flexattn.flex_attention(*qkv, **kw)
    want = attention_reference(*(t.double() for t in qkv), **kw)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def grads(qkv, block_mask, reference=False):
    ts = [(t.double() if reference else t).detach().requires_grad_() for t in qkv]
    fn = attention_reference if reference else flexattn.flex_attention
    fn(*ts, block_mask=block_mask).sum().backward()
    return [t.grad.double() for t in ts]


@pytest.mark.parametrize("layout", ["int64", "strided"])
def test_tables_that_are_copied_are_copied_again_after_an_in_place_change(qkv, layout):
    """Launch tables copy a mask's int64 or row-strided tables: an in-place change of one makes
    the copy again (the int32 contiguous tables are read where they are)."""
    made = create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=32)
    num, idx, full_num, full_idx = made.as_tuple()[2:6]
    if layout == "int64":
        num, idx, full_num, full_idx = (t.long() for t in (num, idx, full_num, full_idx))
    else:
        def strided(t):
            wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
            wide[..., ::2] = t
            return wide[..., ::2]
        full_num = strided(full_num)
    bm = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=32, mask_mod=causal, seq_lengths=(S, S))
    assert_matches_reference(qkv, block_mask=bm)
    bm.full_kv_num_blocks.zero_()  # (now only the partial diagonal tiles are visited)
    assert_matches_reference(qkv, block_mask=bm)


def test_the_transposed_lists_follow_an_in_place_change(qkv):
    """A mask without q_* tables: the backward's transposed lists are made again after the KV
    lists change in place."""
    made = create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=32)
    bm = BlockMask.from_kv_blocks(*made.as_tuple()[2:6], BLOCK_SIZE=32, mask_mod=causal, seq_lengths=(S, S),
                                  compute_q_blocks=False)
    grads(qkv, bm)
    bm.full_kv_num_blocks[0, 0, 3] = 1  # query block 3 sees only KV block 0 in full now
    for name, a, e in zip(("dq", "dk", "dv"), grads(qkv, bm), grads(qkv, bm, reference=True)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4, msg=name)


def test_the_ranked_lists_follow_an_in_place_change():
    """Deterministic mode's ranked lists (made from the transposed ones, which are new tensors
    after the KV lists change in place) are made again too: each rank counts the lower KV blocks
    that visit a query block under the lists as they are now."""
    from flexattn.kernels.tables import ordered_q_lists, tables_of

    made = create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=32)
    bm = BlockMask.from_kv_blocks(*made.as_tuple()[2:6], BLOCK_SIZE=32, mask_mod=causal, seq_lengths=(S, S),
                                  compute_q_blocks=False)
    tables = tables_of(bm)
    before = ordered_q_lists(tables, S)
    assert ordered_q_lists(tables, S) is before  # (made once)
    bm.full_kv_num_blocks[0, 0, 3] = 1  # query block 3 sees only KV block 0 in full now
    after = ordered_q_lists(tables, S)
    ranks = {(n, int(e) & 0x7FFF): int(e) >> 16 for n in range(after.num.shape[-1])
             for e in after.idx[0, 0, n, :int(after.num[0, 0, n])]}
    assert ranks[(0, 3)] == 0 and ranks[(3, 3)] == 1 and (1, 3) not in ranks  # (KV blocks 1, 2 dropped)


def test_a_mask_mod_assigned_later_is_the_one_that_runs(qkv):
    """torch's BlockMask semantics: ``bm.mask_mod = f`` after a call makes the next call run f."""
    everything = create_block_mask(lambda b, h, q, kv: (q + kv) % 2 == 0, None, None, S, S, device="cpu",
                                   BLOCK_SIZE=32)  # (every tile partial)
    assert_matches_reference(qkv, block_mask=everything)
    everything.mask_mod = causal
    assert_matches_reference(qkv, block_mask=everything)
    assert everything.mod.key() != flexattn.create_block_mask(
        lambda b, h, q, kv: (q + kv) % 2 == 0, None, None, S, S, device="cpu", BLOCK_SIZE=32).mod.key()


def test_seq_lengths_assigned_later_are_checked(qkv):
    bm = create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=32)
    assert_matches_reference(qkv, block_mask=bm)
    bm.seq_lengths = (140, 140)
    with pytest.raises(ValueError, match="140"):
        flexattn.flex_attention(*qkv, block_mask=bm)


class Config:
    scale = 1.0


def test_a_class_attribute_read_through_an_instance(qkv):
    """``cfg.scale`` where ``scale`` lives on cfg's class: changing it changes the next call."""
    cfg = Config()

    def scaled(score, b, h, q_idx, kv_idx):
        return score * cfg.scale

    try:
        assert_matches_reference(qkv, score_mod=scaled)
        Config.scale = 3.0
        assert_matches_reference(qkv, score_mod=scaled)
    finally:
        Config.scale = 1.0


def test_negative_zero_is_another_constant(qkv):
    def slope_of(z):
        return lambda score, b, h, q_idx, kv_idx: score + 0.05 * kv_idx * torch.clamp(1.0 / ((kv_idx * 0 + 1) * z),
                                                                                    -1.0, 1.0)
    assert_matches_reference(qkv, score_mod=slope_of(0.0))
    assert_matches_reference(qkv, score_mod=slope_of(-0.0))


def test_a_value_read_on_the_host_is_read_again(qkv):
    """``temp.item()`` in a score_mod folds the value into the IR: the mod is traced again at each
    call (with a warning saying how to avoid it), so an in-place change is seen."""
    temp = torch.tensor(2.0)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * temp.item()

    with pytest.warns(UserWarning, match="reads a captured tensor's value in Python"):
        assert_matches_reference(qkv, score_mod=scaled)
    temp.fill_(5.0)
    assert_matches_reference(qkv, score_mod=scaled)

    def in_the_kernel(score, b, h, q_idx, kv_idx):  # (the tensor itself: read by the kernel, no warning)
        return score * temp

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches_reference(qkv, score_mod=in_the_kernel)
        temp.fill_(3.0)
        assert_matches_reference(qkv, score_mod=in_the_kernel)


class Capped:
    cap = 1.0  # (a class attribute, read through self)

    def mod(self, score, b, h, q_idx, kv_idx):
        return score * self.cap

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score * self.cap * FACTOR


class CappedModule(torch.nn.Module):
    cap = 1.0  # (a class attribute of a module used as the score_mod, read in its forward)

    def forward(self, score, b, h, q_idx, kv_idx):
        return score * self.cap * FACTOR


FACTOR = 1.0


def with_default(score, b, h, q_idx, kv_idx, C=Capped):
    return score * C.cap


def with_attribute(score, b, h, q_idx, kv_idx):
    return score * with_attribute.factor


with_attribute.factor = 1.0


@pytest.mark.parametrize("how", ["bound method", "callable object", "module", "default argument",
                                 "function attribute"])
def test_values_read_through_attributes_of_objects_the_walk_keys_by_identity(qkv, how):
    """What a mod reads through ``self`` (a class attribute of a bound method's or a callable
    object's class), the globals of a callable object's ``__call__``, a class in a default
    argument and a function's own attribute: changing one changes the next call."""
    global FACTOR
    obj = Capped()
    mod = {"bound method": obj.mod, "callable object": obj, "module": CappedModule(), "default argument": with_default,
           "function attribute": with_attribute}[how]
    try:
        assert_matches_reference(qkv, score_mod=mod)
        if how == "function attribute":
            with_attribute.factor = 3.0
        else:
            Capped.cap = CappedModule.cap = 3.0
        assert_matches_reference(qkv, score_mod=mod)
        if how in ("callable object", "module"):
            FACTOR = 0.5
            assert_matches_reference(qkv, score_mod=mod)
    finally:
        Capped.cap = CappedModule.cap = FACTOR = with_attribute.factor = 1.0


def test_a_mask_that_reads_a_value_on_the_host_is_traced_again_on_a_flexattn_block_mask(qkv):
    """A mask_mod that reads a captured tensor's value in Python (``int(t)``) set on a flexattn
    BlockMask sees the tensor's current value at each call, as on torch's BlockMask (the tables
    list every tile as partial: the mask decides every element)."""
    offset = torch.tensor(10)

    def shifted_causal(b, h, q_idx, kv_idx):
        return q_idx + int(offset) >= kv_idx

    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, S, S, "cpu", 32,
                           separate_full_blocks=False)
    bm.mask_mod = shifted_causal
    for value in (10, 70, 0):
        offset.fill_(value)
        assert_matches_reference(qkv, block_mask=bm)


STEP = 0.5


# (torch: an int32 tensor with a Python float is float32; floor(float32(50 * 0.58)) == 29, float64's 28.
# Each reads STEP itself: a number read in a helper stays a constant of the kernel.)
def int_times_float(score, b, h, q_idx, kv_idx):
    return torch.where(torch.floor(kv_idx * STEP) == 29, score + 5, score)


def float_times_int(score, b, h, q_idx, kv_idx):
    return torch.where(torch.floor(STEP * kv_idx) == 29, score + 5, score)


def torch_mul(score, b, h, q_idx, kv_idx):
    return torch.where(torch.floor(torch.mul(kv_idx, STEP)) == 29, score + 5, score)


def clamp_at_a_float_computed_from_it(score, b, h, q_idx, kv_idx):
    return torch.where(torch.floor(torch.clamp(kv_idx, max=STEP * 100) * 0.58) == 29, score + 5, score)


def negated_twice(score, b, h, q_idx, kv_idx):
    return torch.where(torch.floor(kv_idx * -(-(STEP * 1.0))) == 29, score + 5, score)


@pytest.mark.parametrize("mod", [int_times_float, float_times_int, torch_mul, clamp_at_a_float_computed_from_it,
                                 negated_twice],
                         ids=lambda f: f.__name__)
def test_a_changing_python_float_promotes_as_a_python_float(mod):
    """A Python float that changes between calls is passed as a 0-d tensor; it still promotes as a
    Python float (weakly: with an int32 tensor it is float32, as in torch), in operators, torch
    functions and numbers computed from it, also where the inputs, and so the score, are float64."""
    global STEP
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 60, 16, generator=g, dtype=torch.float64) for _ in range(2))
    try:
        for STEP in (0.5, 0.58, 0.58):
            got = flexattn.flex_attention(q, k, v, score_mod=mod)
            torch.testing.assert_close(got, attention_reference(q, k, v, score_mod=mod), atol=1e-12, rtol=1e-12)
    finally:
        STEP = 0.5


SHIFT = 100
TAG = (torch.arange(64) * 7 % 256).to(torch.uint8)


# (torch: a uint8 tensor with a Python int is uint8 and wraps at 256)
def uint8_plus_int(score, b, h, q_idx, kv_idx):
    return score + (TAG[kv_idx] + SHIFT).float() * 0.01


def int_plus_uint8(score, b, h, q_idx, kv_idx):
    return score + (SHIFT + TAG[kv_idx]).float() * 0.01


def torch_add_uint8(score, b, h, q_idx, kv_idx):
    return score + torch.add(TAG[kv_idx], SHIFT * 2).float() * 0.01


@pytest.mark.parametrize("mod", [uint8_plus_int, int_plus_uint8, torch_add_uint8],
                         ids=lambda f: f.__name__)
def test_a_changing_python_int_promotes_as_a_python_int(mod):
    """A Python int that changes between calls is passed as a 0-d int32 tensor; it still promotes
    as a Python int (weakly: with a uint8 tensor it is uint8 and wraps, as in torch)."""
    global SHIFT
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
    try:
        for SHIFT in (100, 120, 140):
            got = flexattn.flex_attention(q, k, v, score_mod=mod)
            torch.testing.assert_close(got.double(), attention_reference(q, k, v, score_mod=mod), atol=1e-5, rtol=1e-5)
    finally:
        SHIFT = 100


GAIN = 1.0


class Knobs:
    gains = [1.0]  # (a class attribute that is a list, read through an instance)
    pair = (1.0, 1.0)  # (a class attribute rebound to another tuple)
    scale = 1.0

    class Inner:  # (a class read through an instance)
        scale = 1.0

    @property
    def gain(self):  # (a property that reads a global)
        return GAIN


class Holder:
    def __init__(self):
        self.knobs = Knobs()  # (an object held by an object: its class attributes)


class Sub(torch.nn.Module):
    scale = 1.0


class WithSub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = Sub()  # (a submodule: in _modules, not the instance's own attributes)

    def forward(self, score, b, h, q_idx, kv_idx):
        return score * self.sub.scale


class CapturesSelf:
    scale = 1.0

    def __call__(self, score, b, h, q_idx, kv_idx):
        by = lambda s: s * self.scale  # noqa: E731 - (self read as a cell, also by this function)
        return by(score)


def _nested_reader(knobs):
    def mod(score, b, h, q_idx, kv_idx):
        return (lambda s: s * knobs.scale)(score)  # (the closure cell read in a nested function)
    return mod


@pytest.mark.parametrize("how", ["class list", "class tuple", "property", "class in a class", "__class__",
                                 "held object", "submodule", "self in a nested function",
                                 "cell in a nested function"])
def test_values_read_through_instances_and_nested_functions(qkv, how):
    """What a mod reads through an instance from its class (a list, a tuple, a property's
    global, a class's attribute), through an object or submodule an object holds, and through
    ``self`` or a closure cell in a nested function: changing it changes the next call (each kept
    the kernel of the old value)."""
    global GAIN
    knobs, holder = Knobs(), Holder()
    mods = {
        "class list": lambda score, b, h, q_idx, kv_idx: score * knobs.gains[0],
        "class tuple": lambda score, b, h, q_idx, kv_idx: score * knobs.pair[1],
        "property": lambda score, b, h, q_idx, kv_idx: score * knobs.gain,
        "class in a class": lambda score, b, h, q_idx, kv_idx: score * knobs.Inner.scale,
        "__class__": lambda score, b, h, q_idx, kv_idx: score * knobs.__class__.scale,
        "held object": lambda score, b, h, q_idx, kv_idx: score * holder.knobs.scale,
        "submodule": WithSub(), "self in a nested function": CapturesSelf(),
        "cell in a nested function": _nested_reader(knobs)}
    mod = mods[how]
    try:
        assert_matches_reference(qkv, score_mod=mod)
        Knobs.gains[0] = 3.0
        Knobs.pair = (1.0, 3.0)
        GAIN = Knobs.scale = Knobs.Inner.scale = Sub.scale = CapturesSelf.scale = 3.0
        assert_matches_reference(qkv, score_mod=mod)
    finally:
        Knobs.gains[0], Knobs.pair = 1.0, (1.0, 1.0)
        GAIN = Knobs.scale = Knobs.Inner.scale = Sub.scale = CapturesSelf.scale = 1.0


def test_a_dict_whose_keys_took_over_freed_keys_addresses(qkv):
    """A dict keyed by tuples, made again with other keys at the freed keys' addresses (and the
    same values in the same order): the fingerprint keyed dict keys by ``id``, and the second call
    ran the first dict's kernel (its d[(0, 1)])."""
    def reader(d):
        return lambda score, b, h, q_idx, kv_idx: score * d[(0, 1)]

    k1, k2 = tuple([0, 1]), tuple([1, 0])
    d = {k1: 1.0, k2: 3.0}
    # (without depending on the allocator: equal dicts with other key objects have one fingerprint,
    # as the keys are walked as values; keyed by id they would differ)
    from flexattn import modcache
    twin = {tuple([0, 1]): 1.0, tuple([1, 0]): 3.0}
    assert modcache.fingerprint(reader(d))[0] == modcache.fingerprint(reader(twin))[0] is not None
    swapped = {tuple([1, 0]): 1.0, tuple([0, 1]): 3.0}
    assert modcache.fingerprint(reader(d))[0] != modcache.fingerprint(reader(swapped))[0]
    addresses = [id(k) for k in d]
    assert_matches_reference(qkv, score_mod=reader(d))
    del d, k1, k2
    kx, ky = tuple([0, 1]), tuple([1, 0])  # (made in the other order: the freed addresses, swapped)
    d = {ky: 1.0, kx: 3.0}
    if [id(k) for k in d] != addresses:
        pytest.skip("the allocator gave the new keys other addresses")
    assert_matches_reference(qkv, score_mod=reader(d))


class _Reflected:
    scale = 1.0


_REFLECTED = _Reflected()


def through_getattr(score, b, h, q_idx, kv_idx):
    return score * getattr(_Reflected, "scale")


def through_type(score, b, h, q_idx, kv_idx):
    return score * type(_REFLECTED).scale


def through_a_helper(score, b, h, q_idx, kv_idx):
    return score * _scale_of(_REFLECTED)


def _scale_of(obj):
    return type(obj).scale


@pytest.mark.parametrize("mod", [through_getattr, through_type, through_a_helper], ids=lambda f: f.__name__)
def test_attributes_read_through_getattr_or_type_are_read_at_every_call(mod):
    """``getattr(cfg, name)`` and ``type(self).scale`` read an attribute that no attribute chain
    names: the mod is traced at every call, so a changed class value is seen."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    try:
        for _Reflected.scale in (1.0, 3.0, 0.5):
            got = flexattn.flex_attention(q, k, v, score_mod=mod)
            torch.testing.assert_close(got.double(), attention_reference(q, k, v, score_mod=mod), atol=1e-5, rtol=1e-5)
    finally:
        _Reflected.scale = 1.0


def test_dicts_with_the_same_values_under_other_keys(qkv):
    """Two dicts holding the same values in the same order under swapped keys: the mod reads
    another number from each (the fingerprint keys a dict's keys, not only its values)."""
    def reader(cfg):
        return lambda score, b, h, q_idx, kv_idx: score * cfg["scale"] + cfg["shift"] * (q_idx - kv_idx) * 0.01

    assert_matches_reference(qkv, score_mod=reader({"scale": 2.0, "shift": 0.5}))
    assert_matches_reference(qkv, score_mod=reader({"shift": 2.0, "scale": 0.5}))


def test_keyword_only_defaults_the_mod_reads(qkv):
    """A keyword-only default of the mod (``*, scale=...``) made anew for each value is read anew."""
    def make(value):
        def mod(score, b, h, q_idx, kv_idx, *, scale=value):
            return score * scale
        return mod

    for value in (2.0, 0.25, 2.0):
        assert_matches_reference(qkv, score_mod=make(value))
