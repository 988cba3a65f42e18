"""Packed arrays (`programs/packing.py`) and what the stage programs pass packed."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resilient_jax.programs.packing import PACK_MAX_BYTES, Layout, Packed


def _tree() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    "b.kernel": rng.standard_normal((3, 4)).astype(np.float32),
    "a.scale": rng.standard_normal((5,)).astype(np.float32),
    "c.table": rng.standard_normal((2, 2)).astype(jnp.bfloat16),
    "d.step": np.array(7, np.int32),
    "e.empty": np.zeros((0, 3), np.float32),
  }


def test_a_packed_tree_reads_back_every_array_bitwise_in_one_buffer_per_dtype():
  tree = _tree()
  packed = Packed.from_dict(tree)
  assert [b.dtype for b in packed.buffers] == [np.float32, jnp.bfloat16, np.int32]
  assert [b.shape for b in packed.buffers] == [(17,), (4,), (1,)]
  assert list(packed) == sorted(tree) and len(packed) == 5 and "d.step" in packed
  for name, value in tree.items():
    got = np.asarray(packed[name])
    assert got.shape == value.shape and got.dtype == value.dtype
    np.testing.assert_array_equal(got, value)
  # Inside a trace as outside: a program takes and returns it, one argument per buffer.
  doubled = jax.jit(lambda p: Packed.from_dict({n: v * 2 for n, v in p.unpacked().items()}))(
    packed)
  np.testing.assert_array_equal(np.asarray(doubled["b.kernel"]), tree["b.kernel"] * 2)
  assert len(jax.tree.leaves(doubled)) == 3
  # `jax.tree.map` maps the buffers: a zero, a scale.
  zeros = jax.tree.map(jnp.zeros_like, packed)
  assert zeros.layout == packed.layout and not np.asarray(zeros["a.scale"]).any()


def test_replace_writes_some_names_and_keeps_the_rest():
  tree = _tree()
  packed = Packed.from_dict(tree)
  new = packed.replace({"a.scale": np.arange(5, dtype=np.float32),
                        "c.table": np.ones((2, 2), jnp.bfloat16)})
  np.testing.assert_array_equal(np.asarray(new["a.scale"]), np.arange(5))
  np.testing.assert_array_equal(np.asarray(new["c.table"]).astype(np.float32), np.ones((2, 2)))
  for name in ("b.kernel", "d.step"):
    np.testing.assert_array_equal(np.asarray(new[name]), tree[name])
  with pytest.raises(KeyError):
    packed["missing"]


def test_a_layout_is_equal_by_value():
  """A layout is part of a program's argument structure, by which its executable is looked up:
  another object describing the same arrays must find the same program."""
  tree = _tree()
  layout = Layout.of(tree)
  again = Layout(layout.names, layout.shapes, layout.dtypes, layout.chunks)
  assert again is not layout
  assert again == layout and hash(again) == hash(layout)
  assert Layout.of({**tree, "a.scale": tree["a.scale"][:4]}) != layout
  assert jax.tree.structure(Packed.from_dict(tree)) == jax.tree.structure(
    Packed(again, Packed.from_dict(tree).buffers))


def test_a_stage_passes_its_residuals_and_gradients_packed():
  """A whole-model stage on one device: F hands B and W a few buffers, not one array per
  residual, the gradients are one buffer per dtype, and the packed backward's gradients are
  JAX's own gradient of the stage's loss."""
  from resilient_jax.model.check import token_batch
  from resilient_jax.programs.shared import build_stage_programs
  from resilient_jax.recipe import make_model, make_optimizer, optimizer_key
  from tests.helpers import assert_close, tiny_config

  cfg = tiny_config(mesh__dp=1, mesh__pp=1)
  model = make_model(cfg)
  (prog,) = build_stage_programs(
    model, cfg.partition, token_batch(cfg.model.seq_len, cfg.microbatch_size),
    make_optimizer(cfg), cfg.step_batch, optimizer_key=optimizer_key(cfg))
  device = jax.devices()[0]
  params = prog.initial_params(device)
  x = jax.device_put(jnp.ones((cfg.microbatch_size, cfg.model.seq_len), jnp.int32), device)
  loss, res, saved = prog.forward(params, None, {"tokens": x, "targets": x})
  n_res = len(set(prog.split.b_residuals) | set(prog.split.w_residuals))
  packed = jax.tree.leaves((res.packs, saved.packs))
  # The 4 blocks' residuals repeat: a chunk per block, one before and after them, a buffer per
  # dtype of each.
  chunks = [c for pack in (*res.packs, *saved.packs) if pack for c in pack]
  assert n_res > 100 and len(chunks) == 6 and len(packed) <= 12, (n_res, len(packed))
  assert len({c.layout for c in chunks[1:-1]}) == 1  # the blocks' chunks: one layout
  assert len(jax.tree.leaves((res.arrays, saved.arrays))) <= 2  # the tokens, if read
  # The state (parameters, gradients): a buffer per block, one for the arrays outside them.
  zeros = prog.zero_grads(params, device)
  assert isinstance(zeros, Packed) and zeros.layout == params.layout == prog.layout
  assert len(jax.tree.leaves(zeros)) == len(jax.tree.leaves(params)) == 4 + 1
  blocks = [zeros.layout.buffer_names(b) for b in range(4)]
  assert all({n.split(".")[1] for n in names} == {str(b)} for b, names in enumerate(blocks))
  assert len(set(zeros.layout.sizes[:4])) == 1
  g = jax.device_put(jnp.float32(1.0), device)
  _, grads = prog.backward_fused(res, saved, params, g, zeros)
  # The same gradients from JAX's own differentiation of the stage's loss.
  batch = {"tokens": x, "targets": x}
  expected = jax.grad(
    lambda p: prog.apply_stage(p, None, batch)[0].sum() * prog.loss_scale)(params)
  assert_close(loss, prog.apply_stage(params, None, batch)[0].sum() * prog.loss_scale)
  for name in prog.param_names:
    assert_close(grads[name], expected[name], err_msg=name)


def test_repeats_cuts_a_run_of_repeating_keys_into_one_chunk_per_repeat():
  from resilient_jax.programs.packing import repeats

  assert repeats(list("xyabcabcabcz")) == [range(0, 2), range(2, 5), range(5, 8), range(8, 11),
                                           range(11, 12)]
  assert repeats(list("abcd")) == [range(0, 4)] and repeats([]) == []
  assert repeats(list("abab")) == [range(0, 2), range(2, 4)]
  # At equal cover the shorter period: more chunks, each block's kernels shared.
  assert repeats(list("aaaa")) == [range(i, i + 1) for i in range(4)]


def test_an_array_over_the_pack_limit_is_a_buffer_of_its_own():
  """Packing a large array would copy it twice and hold a second copy as scratch, for the
  ~2.5 us of host time an array costs: past `PACK_MAX_BYTES` it passes as itself, reshaped."""
  from resilient_jax.programs.packing import PACK_MAX_BYTES

  big = np.arange(PACK_MAX_BYTES // 4 + 1, dtype=np.float32).reshape(-1, 1)
  tree = {"a.small": np.ones((3,), np.float32), "b.big": big, "c.small": np.zeros((2,), np.float32)}
  packed = Packed.from_dict(tree)
  assert [b.shape for b in packed.buffers] == [(5,), (big.size,)]
  np.testing.assert_array_equal(np.asarray(packed["b.big"]), big)
  np.testing.assert_array_equal(np.asarray(packed["c.small"]), tree["c.small"])


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_the_reduction_sums_packed_gradients_of_several_buffers(dtype):
  """Gradients packed into a small-arrays buffer and a large array's own (or bfloat16) are
  summed over three devices as the named arrays would be, every device holding the same sum."""
  from resilient_jax.programs.packing import PACK_MAX_BYTES
  from resilient_jax.runtime.transport import Transport

  devices = jax.devices()[:3]
  rng = np.random.default_rng(1)
  big = (PACK_MAX_BYTES // np.dtype(dtype).itemsize + 7,)
  parts = [{"a": rng.standard_normal((3, 2)).astype(dtype), "b": rng.standard_normal(big)
            .astype(dtype), "c": rng.standard_normal((4,)).astype(dtype)} for _ in devices]
  local = {d: jax.device_put(Packed.from_dict(p), d) for d, p in zip(devices, parts, strict=True)}
  assert len(jax.tree.leaves(local[devices[0]])) == 2
  out = Transport(dict(enumerate(devices))).reduce(0, [0, 1, 2], tuple(devices), local)
  for name in ("a", "b", "c"):
    want = sum(p[name].astype(np.float32) for p in parts).astype(dtype)
    got = [np.asarray(out[d][name]) for d in devices]
    np.testing.assert_allclose(got[0].astype(np.float32), want.astype(np.float32), rtol=1e-2)
    for g in got[1:]:
      np.testing.assert_array_equal(g, got[0])


def test_a_reduction_in_one_process_spreads_its_bytes_over_the_devices():
  """Four local members, spread: each piece of the buffer is summed on its own member (in the
  members' order: numpy's float32 sum in that order, to the bit, on every member), and every
  device sends and receives 2 (k - 1) / k of the buffer; summed on the first member (what CPU
  devices, one memory, do by default), the same sum, and the first receives and sends k - 1
  whole buffers."""
  from resilient_jax.runtime.transport import Transport
  from resilient_jax.schedule import ring

  devices = jax.devices()[:4]
  rng = np.random.default_rng(2)
  parts = [{"a": rng.standard_normal((37,)).astype(np.float32),
            "b": rng.standard_normal((PACK_MAX_BYTES // 4 + 5,)).astype(np.float32)}
           for _ in devices]
  local = {d: jax.device_put(Packed.from_dict(p), d) for d, p in zip(devices, parts, strict=True)}
  elements = 37 + PACK_MAX_BYTES // 4 + 5
  piece = -(-elements // 4) * 4  # bytes of one of the 4 pieces (the buffer zero-padded)
  for spread, most in ((True, (2 * 3 * piece, 2 * 3 * piece)),
                       (False, (3 * elements * 4, 3 * elements * 4))):
    # what the simulator's cost model prices (`schedule.ring.two_level`)
    assert ring.two_level(elements, (4,), spread).device_bytes == most[0]
    transport = Transport(dict(enumerate(devices)))
    transport.spread = spread
    transport.begin(1, 0)
    out = transport.reduce(0, [0, 1, 2, 3], tuple(devices), local)
    for name in ("a", "b"):
      want = ((parts[0][name] + parts[1][name]) + parts[2][name]) + parts[3][name]
      for d in devices:
        np.testing.assert_array_equal(np.asarray(out[d][name]), want)
    # spread: under two buffers whatever the member count; on the first: k - 1 in and out
    assert transport.device_bytes() == most, spread
    transport.begin(2, 0)
    assert transport.device_bytes() == (0, 0)
  assert Transport(dict(enumerate(devices))).pieces_for(devices, tuple(devices)) == 1  # one memory


class _Ring:
  """The transfers of `ProcessTransport._ring` between threads standing in for processes:
  `offer` keeps a process's arrays, `pull` hands them over once offered (on the puller's
  device), counting the bytes each process offers."""

  def __init__(self, num_processes):
    self.num_processes = num_processes
    self.offered, self.sent = {}, {}
    self.ready = threading.Condition()

  def member(self, pid):
    ring = self

    class Cluster:
      process_id, num_processes = pid, ring.num_processes

      def offer(self, uid, arrays):
        with ring.ready:
          ring.offered[(pid, uid)] = arrays
          ring.sent[pid] = ring.sent.get(pid, 0) + sum(a.nbytes for a in arrays)
          ring.ready.notify_all()

      def pull(self, proc, uid, specs, where):
        return [(proc, uid, where)]

      def wait(self, got, what, peers):
        for box in got:
          proc, uid, where = box[0]
          with ring.ready:
            key = (proc, uid)
            assert ring.ready.wait_for(lambda key=key: key in ring.offered, timeout=60), what
            box[:] = jax.device_put(ring.offered[(proc, uid)], where)
        return None

    return Cluster()


def test_a_ring_that_lost_a_member_cuts_into_its_members():
  """`ProcessTransport._ring` over 3 of a job's 4 processes (one lost): each piece cut into 3
  chunks, not the job's 4 (a position owning 2 of 4 would pace every hop), every member ending
  with bitwise the same sum, in the ring's fixed order, and sending the bytes the simulator
  prices (`ring.bytes_sent`)."""
  from resilient_jax.runtime.multiprocess import ProcessTransport
  from resilient_jax.runtime.transport import pieces
  from resilient_jax.schedule import ring

  devices, procs, elements = jax.devices()[:3], [0, 2, 3], 1001
  rng = np.random.default_rng(5)
  parts = [rng.standard_normal(elements).astype(np.float32) for _ in procs]
  fake, out = _Ring(4), {}
  cut, join = pieces(elements, 3)  # a piece in its ring's chunks, as `_ring_programs` cuts it

  def run(r):
    t = object.__new__(ProcessTransport)
    t.cluster, t.step, t.attempt, t.pause, t.doomed = fake.member(procs[r]), 3, 0, None, []
    partial = jax.device_put(parts[r], devices[r])
    out[r] = t._ring(0, procs, [tuple(cut(partial))], [devices[r]])

  threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  sums = [np.asarray(join(*out[r][0])) for r in range(3)]
  for s in sums[1:]:
    np.testing.assert_array_equal(s, sums[0])
  size = ring.piece_elements(elements, 3)
  for c in range(3):  # chunk c summed round the ring from position c to its owner, c - 1
    part = slice(c * size, (c + 1) * size)
    want = (parts[c][part] + parts[(c + 1) % 3][part]) + parts[(c + 2) % 3][part]
    np.testing.assert_array_equal(sums[0][part], want)
  assert fake.sent == {p: ring.bytes_sent(elements, 3) for p in procs}
  assert ring.bytes_sent(elements, 3) == 2 * 2 * ring.piece_elements(elements, 3) * 4
