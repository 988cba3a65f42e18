"""Tests for resilient_jax.data: id-addressed sources, batch plans, digests, micro-batch split."""

from __future__ import annotations

import numpy as np
import pytest

from resilient_jax import data


@pytest.fixture(scope="module")
def text_source() -> data.TextSource:
  return data.TextSource(seq_len=64)


@pytest.mark.parametrize("kind", ["synthetic", "text"])
def test_get_is_deterministic_per_id_independent_of_batching(kind: str) -> None:
  src = data.make_source(kind, vocab_size=256, seq_len=32, seed=3)
  ids = np.array([5, 0, 17, 2, 9], dtype=np.int64)
  inputs, targets = src.get(ids)
  assert inputs.shape == targets.shape == (5, 32)
  assert inputs.dtype == targets.dtype == np.int32
  assert inputs.min() >= 0 and inputs.max() < src.vocab_size
  # One at a time, reversed, and mixed with other ids: the rows for each id never change.
  for k, sample_id in enumerate(ids):
    single_in, single_tgt = src.get(np.array([sample_id]))
    np.testing.assert_array_equal(single_in[0], inputs[k])
    np.testing.assert_array_equal(single_tgt[0], targets[k])
  rev_in, _ = src.get(ids[::-1])
  np.testing.assert_array_equal(rev_in, inputs[::-1])
  mixed_in, _ = src.get(np.array([100, 17, 3, 5]))
  np.testing.assert_array_equal(mixed_in[1], inputs[2])
  np.testing.assert_array_equal(mixed_in[3], inputs[0])
  # A fresh source object gives the same tokens (nothing depends on call history).
  again_in, _ = data.make_source(kind, vocab_size=256, seq_len=32, seed=3).get(ids)
  np.testing.assert_array_equal(again_in, inputs)


def test_synthetic_seed_and_id_matter() -> None:
  a = data.SyntheticSource(vocab_size=128, seq_len=64, seed=0)
  b = data.SyntheticSource(vocab_size=128, seq_len=64, seed=1)
  a_in, _ = a.get(np.arange(4))
  assert not np.array_equal(a_in, b.get(np.arange(4))[0])
  assert len({row.tobytes() for row in a_in}) == 4
  assert a.num_samples is None


def test_synthetic_has_learnable_structure() -> None:
  vocab = 128
  src = data.SyntheticSource(vocab_size=vocab, seq_len=128, seed=0)
  inputs, targets = src.get(np.arange(256))
  # Targets are the inputs shifted by one position.
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
  # Predict each next token by extrapolating the last step: x[t+1] = 2 x[t] - x[t-1] (mod V).
  pred = (2 * inputs[:, 1:].astype(np.int64) - inputs[:, :-1]) % vocab
  acc = float(np.mean(pred == targets[:, 1:]))
  # Chance is 1/128; with 10% noise about 0.9**3 ~ 0.73 of positions are clean triples.
  assert acc > 0.6, acc


def test_text_source_returns_shipped_bytes(text_source: data.TextSource) -> None:
  raw = data.default_text_path().read_bytes()
  assert 150_000 <= len(raw) <= 300_000
  assert raw.isascii()
  assert raw.startswith(b'The "assert" statement')
  src = text_source
  assert src.vocab_size == 256
  assert src.num_samples == -(-(len(raw) - 64 - 1) // 64)
  ids = np.array([0, 1, 7, src.num_samples - 1])
  inputs, targets = src.get(ids)
  for k, sample_id in enumerate(ids):
    start = int(sample_id) * 64
    assert bytes(inputs[k].astype(np.uint8)) == raw[start : start + 64]
    assert bytes(targets[k].astype(np.uint8)) == raw[start + 1 : start + 65]
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


def test_text_source_windows_are_distinct_and_in_range(text_source: data.TextSource) -> None:
  src = text_source
  starts = (np.arange(src.num_samples) * src.seq_len) % (src.data.size - src.seq_len - 1)
  assert len(set(starts.tolist())) == src.num_samples  # non-overlapping, no wrap inside an epoch
  assert starts.max() + src.seq_len + 1 <= src.data.size
  # Ids past the end wrap by the documented formula instead of failing.
  wrapped_in, _ = src.get(np.array([src.num_samples + 3]))
  start = ((src.num_samples + 3) * src.seq_len) % (src.data.size - src.seq_len - 1)
  np.testing.assert_array_equal(wrapped_in[0], src.data[start : start + src.seq_len])


def test_text_source_custom_path(tmp_path) -> None:
  path = tmp_path / "t.txt"
  path.write_bytes(bytes(range(40)))
  src = data.TextSource(seq_len=8, path=path)
  assert src.num_samples == 4  # starts 0, 8, 16, 24 are < 40 - 8 - 1
  inputs, targets = src.get(np.array([3]))
  np.testing.assert_array_equal(inputs[0], np.arange(24, 32))
  np.testing.assert_array_equal(targets[0], np.arange(25, 33))
  with pytest.raises(ValueError, match="needs at least"):
    data.TextSource(seq_len=39, path=path)


def test_batch_plan_covers_each_epoch_exactly_once_shuffled() -> None:
  n, batch = 40, 8
  plan = data.BatchPlan(n, batch, seed=7)
  steps_per_epoch = n // batch
  for epoch in range(3):
    ids = np.concatenate(
      [plan.ids_for_step(s) for s in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)]
    )
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))
    assert not np.array_equal(ids, np.arange(n))  # actually shuffled
  assert not np.array_equal(plan.epoch_permutation(0), plan.epoch_permutation(1))
  unshuffled = data.BatchPlan(n, batch, seed=7, shuffle=False)
  np.testing.assert_array_equal(unshuffled.ids_for_step(6), np.arange(8, 16))


def test_batch_plan_is_pure_function_of_seed_and_step() -> None:
  plan = data.BatchPlan(50, 12, seed=1)
  forward = [plan.ids_for_step(s) for s in range(20)]
  fresh = data.BatchPlan(50, 12, seed=1)
  # Out-of-order queries on a fresh object (as after a resume) give identical ids.
  for s in [19, 3, 11, 0, 7]:
    np.testing.assert_array_equal(fresh.ids_for_step(s), forward[s])
  other_seed = data.BatchPlan(50, 12, seed=2)
  assert not np.array_equal(other_seed.ids_for_step(0), forward[0])
  with pytest.raises(ValueError):
    plan.ids_for_step(-1)


def test_batch_plan_straddles_epochs() -> None:
  n, batch = 10, 4
  plan = data.BatchPlan(n, batch, seed=0)
  e0, e1 = plan.epoch_permutation(0), plan.epoch_permutation(1)
  # Step 2 covers stream positions 8..11: tail of epoch 0 then head of epoch 1.
  np.testing.assert_array_equal(plan.ids_for_step(2), np.concatenate([e0[8:], e1[:2]]))
  np.testing.assert_array_equal(plan.ids_for_step(4), e1[6:])  # ends exactly at the epoch edge
  stream = np.concatenate([plan.ids_for_step(s) for s in range(5)])
  np.testing.assert_array_equal(stream, np.concatenate([e0, e1]))


def test_batch_plan_infinite() -> None:
  plan = data.BatchPlan(None, 6, seed=9)
  np.testing.assert_array_equal(plan.ids_for_step(0), np.arange(6))
  np.testing.assert_array_equal(plan.ids_for_step(3), np.arange(18, 24))
  assert plan.ids_for_step(3).dtype == np.int64
  assert plan.steps_per_epoch is None
  with pytest.raises(ValueError):
    plan.epoch_permutation(0)


def test_sample_digest() -> None:
  ids = np.array([3, 1, 4, 15, 9], dtype=np.int64)
  d = data.sample_digest(ids)
  assert len(d) == 16 and int(d, 16) >= 0
  assert data.sample_digest(ids[::-1]) == d
  assert data.sample_digest(np.array([9, 15, 4, 1, 3], dtype=np.int32)) == d  # dtype-insensitive
  assert data.sample_digest(np.array([3, 1, 4, 15, 8])) != d
  assert data.sample_digest(np.array([3, 1, 4, 15])) != d
  # Across a plan: different steps of one epoch are different sets, a recomputed step is the same.
  plan = data.BatchPlan(64, 8, seed=0)
  digests = [data.sample_digest(plan.ids_for_step(s)) for s in range(8)]
  assert len(set(digests)) == 8
  assert data.sample_digest(data.BatchPlan(64, 8, seed=0).ids_for_step(5)) == digests[5]


def test_split_microbatches_layout() -> None:
  ids = np.arange(100, 124, dtype=np.int64)
  mbs = data.split_microbatches(ids, dp=2, microbatches=3)
  assert mbs.shape == (6, 4) and mbs.dtype == np.int64
  for j in range(6):
    np.testing.assert_array_equal(mbs[j], ids[j * 4 : (j + 1) * 4])
  # Pipeline d owns rows d*m .. d*m+m-1: pipeline 1 gets the second half of the batch.
  np.testing.assert_array_equal(mbs[3:6].ravel(), ids[12:])


@pytest.mark.parametrize(("n", "dp", "m"), [(10, 2, 3), (4, 2, 4), (0, 1, 1)])
def test_split_microbatches_errors(n: int, dp: int, m: int) -> None:
  with pytest.raises(ValueError, match="train.global_batch") as info:
    data.split_microbatches(np.arange(n), dp=dp, microbatches=m)
  assert "mesh.dp" in str(info.value) and "pipeline.microbatches" in str(info.value)


def test_make_source_errors() -> None:
  with pytest.raises(ValueError, match="synthetic, text"):
    data.make_source("imagenet", vocab_size=256, seq_len=8, seed=0)
  with pytest.raises(ValueError, match="model.vocab_size"):
    data.make_source("text", vocab_size=128, seq_len=8, seed=0)
  assert isinstance(data.make_source("text", vocab_size=512, seq_len=8, seed=0), data.DataSource)
  synthetic = data.make_source("synthetic", vocab_size=64, seq_len=8, seed=0)
  assert isinstance(synthetic, data.SyntheticSource) and synthetic.vocab_size == 64


# --- token files (train.data=tokens) ----------------------------------------------------------


def test_shipped_token_file_is_the_shipped_text_prepared(tmp_path):
  made = data.prepare_tokens(data.default_text_path(), tmp_path / "t.bin")
  assert made.read_bytes() == data.default_tokens_path().read_bytes()


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_windows_are_the_text_windows(tmp_path, dtype):
  path = data.prepare_tokens(data.default_text_path(), tmp_path / f"t.{dtype}", dtype)
  tokens = data.TokenSource(16, 256, path, dtype)
  text = data.TextSource(16)
  ids = np.array([0, 5, 7, 3, tokens.num_samples - 1])
  for a, b in zip(tokens.get(ids), text.get(ids), strict=True):
    np.testing.assert_array_equal(a, b)
  x, y = tokens.get(ids)
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next tokens


@pytest.mark.parametrize("content,dtype,message", [
  (None, "uint16", "is not a file"),
  (b"\x01\x00\x02", "uint16", "not a whole number of uint16 token ids"),
  (np.arange(4, dtype=np.uint16).tobytes(), "uint16", "needs at least 18"),
  (np.full(40, 300, dtype=np.uint16).tobytes(), "uint16", "token id 300, not below"),
])
def test_a_bad_token_file_names_the_problem(tmp_path, content, dtype, message):
  path = tmp_path / "bad.bin"
  if content is not None:
    path.write_bytes(content)
  with pytest.raises(ValueError, match=message):
    data.TokenSource(16, 256, path, dtype)


def test_an_arrayrecord_token_file_is_one_stream_of_its_records(tmp_path):
  from array_record.python import array_record_module

  ids = np.frombuffer(data.default_text_path().read_bytes()[:4000], np.uint8).astype(np.uint32)
  path = tmp_path / "docs.arrayrecord"
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for doc in np.array_split(ids, 7):  # records of different lengths
    writer.write(doc.tobytes())
  writer.close()
  flat = tmp_path / "flat.bin"
  flat.write_bytes(ids.tobytes())
  a, b = data.TokenSource(16, 256, path, "uint32"), data.TokenSource(16, 256, flat, "uint32")
  assert a.num_samples == b.num_samples
  sample = np.arange(a.num_samples)
  for x, y in zip(a.get(sample), b.get(sample), strict=True):
    np.testing.assert_array_equal(x, y)
  (tmp_path / "broken.arrayrecord").write_bytes(b"not an array record")
  with pytest.raises(ValueError, match="not a readable ArrayRecord file"):
    data.TokenSource(16, 256, tmp_path / "broken.arrayrecord")


def test_a_bad_token_file_is_a_config_error(tmp_path):
  from resilient_jax.config import ConfigError
  from resilient_jax.recipe import make_data
  from tests.helpers import tiny_config

  cfg = tiny_config(train__data="tokens", train__data_path=str(tmp_path / "missing.bin"))
  with pytest.raises(ConfigError, match="is not a file"):  # the launcher: one line, exit 2
    make_data(cfg)
