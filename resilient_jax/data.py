"""Deterministic, id-addressed training data.

Every training step consumes a known set of *sample ids*, and every sample id maps to the same
tokens no matter which other ids are requested with it, in what order, or on which worker. Two
pure functions make this work:

* `DataSource.get(ids)`: id -> tokens, a function of the id alone (and the source's seed);
* `BatchPlan.ids_for_step(step)`: step -> ids, a function of `(seed, step)` alone.

So the data position saved in a checkpoint is just the step number: resuming at step `t` asks the
plan for `ids_for_step(t)` and gets exactly the samples the uninterrupted run would have seen, and
when the coordinator re-routes micro-batches to surviving peers after a failure, those peers
fetch the same samples by id instead of receiving them from the failed worker. `sample_digest`
turns a step's ids into a short fingerprint so logs and tests can check "same samples" cheaply.

Shipped corpus: `resilient_jax/corpus/python_reference.txt` is the Python language reference
topic text from CPython 3.11's `Lib/pydoc_data/topics.py` (Copyright Python Software Foundation,
distributed under the PSF License Agreement, which permits redistribution). It was built by
joining `topics[k]` for `k` in sorted key order with a blank line between topics, mapping the few
typographic characters (curly quotes, dashes, ellipsis, ...) to ASCII, stripping trailing
whitespace, and truncating at the last line boundary before 256 KiB. The file is pure ASCII, so
byte-level tokens are exactly its characters. `python_reference.u16.bin` is the same text as
token ids in the flat binary format nanoGPT-style preparers write (`prepare_tokens`), what
`train.data=tokens` reads when `train.data_path` is empty.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
  "BatchPlan",
  "Batched",
  "RecordSource",
  "DataSource",
  "SyntheticSource",
  "TextSource",
  "TokenSource",
  "held_out",
  "make_source",
  "sample_shapes",
  "prepare_tokens",
  "sample_digest",
  "split_microbatches",
]

SOURCE_KINDS = ("synthetic", "text", "tokens")
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TEXT_VOCAB_SIZE = 256  # byte-level


@runtime_checkable
class DataSource(Protocol):
  """A deterministic map from sample id to one `(inputs, targets)` token sequence pair.

  Attributes:
    num_samples: Number of distinct samples, or None for an infinite id space.
    seq_len: Tokens per sample.
    vocab_size: Every token lies in `[0, vocab_size)`.
  """

  num_samples: int | None
  seq_len: int
  vocab_size: int

  def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns int32 `(inputs, targets)`, each `[len(ids), seq_len]`; row k belongs to `ids[k]`."""
    ...


class TokenWindows:
  """What the shipped token sources share: `batch(ids)`, a step's samples as the batch a loss
  reads, `{"tokens": inputs, "targets": targets}` (`Batched`), and `source[i]`, one sample."""

  def batch(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    inputs, targets = self.get(ids)
    return {"tokens": inputs, "targets": targets}

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in self.batch(np.asarray([i])).items()}

  def __len__(self) -> int:
    if self.num_samples is None:
      raise TypeError("an endless source has no length")
    return self.num_samples


def _as_ids(ids: np.ndarray) -> np.ndarray:
  """Validates and flattens a batch of sample ids to int64."""
  arr = np.asarray(ids)
  if arr.ndim != 1:
    raise ValueError(f"sample ids must be 1-D, got shape {arr.shape}")
  if arr.size and not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"sample ids must be integers, got dtype {arr.dtype}")
  arr = arr.astype(np.int64, copy=False)
  if arr.size and arr.min() < 0:
    raise ValueError(f"sample ids must be non-negative, got min {arr.min()}")
  return arr


class SyntheticSource(TokenWindows):
  """Infinite synthetic sequences with learnable structure.

  Sample `i` draws everything from `np.random.default_rng([seed, i])`: a start token, a stride in
  `1..max_stride`, and a noise mask. The clean sequence is the arithmetic progression
  `start + stride * t (mod vocab_size)`; each position is then replaced by a uniformly random token
  with probability `noise`. A model that infers the stride from context predicts most next tokens,
  so the loss drops visibly well below `log(vocab_size)`, while the noise keeps it from reaching 0.
  """

  def __init__(
    self, vocab_size: int, seq_len: int, seed: int, *, noise: float = 0.1, max_stride: int = 4
  ) -> None:
    """Creates the source.

    Args:
      vocab_size: Token range `[0, vocab_size)`; at least 2.
      seq_len: Tokens per sample; at least 1.
      seed: Non-negative seed; with the id it fully determines a sample.
      noise: Probability that a position is replaced by a random token.
      max_stride: Largest progression stride (clipped to `vocab_size - 1`).
    """
    if vocab_size < 2:
      raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if seed < 0:
      raise ValueError(f"seed must be non-negative, got {seed}")
    if not 0.0 <= noise <= 1.0:
      raise ValueError(f"noise must be in [0, 1], got {noise}")
    self.vocab_size = int(vocab_size)
    self.seq_len = int(seq_len)
    self.seed = int(seed)
    self.noise = float(noise)
    self.max_stride = max(1, min(int(max_stride), self.vocab_size - 1))
    self.num_samples: int | None = None

  def _sequence(self, sample_id: int) -> np.ndarray:
    """The `seq_len + 1` tokens of one sample; inputs and targets are its two shifted views."""
    rng = np.random.default_rng([self.seed, sample_id])
    n = self.seq_len + 1
    start = rng.integers(self.vocab_size)
    stride = rng.integers(1, self.max_stride + 1)
    seq = (start + stride * np.arange(n, dtype=np.int64)) % self.vocab_size
    # Draw mask and replacements unconditionally so the stream layout never depends on `noise`
    # hitting zero, keeping samples comparable across noise settings.
    mask = rng.random(n) < self.noise
    random_tokens = rng.integers(self.vocab_size, size=n)
    return np.where(mask, random_tokens, seq)

  def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns int32 `(inputs, targets)` of shape `[len(ids), seq_len]`."""
    ids = _as_ids(ids)
    seqs = np.empty((ids.size, self.seq_len + 1), dtype=np.int32)
    for row, sample_id in enumerate(ids.tolist()):
      seqs[row] = self._sequence(sample_id)
    return seqs[:, :-1].copy(), seqs[:, 1:].copy()


def default_text_path() -> Path:
  """Path of the shipped corpus (the Python language reference text)."""
  return Path(str(importlib.resources.files("resilient_jax") / "corpus" / "python_reference.txt"))


class TextSource(TokenWindows):
  """Byte-level (vocab 256) windows over a text file, by default the shipped corpus.

  Sample `i` starts at byte `(i * seq_len) % (len(text) - seq_len - 1)`; its inputs are
  `text[start:start + seq_len]` and its targets the same window shifted by one byte. Ids
  `0 .. num_samples - 1` are the non-overlapping windows; larger ids wrap around (by the formula
  above) rather than fail, so an id is always valid, but a `BatchPlan` never produces them.
  """

  def __init__(self, seq_len: int, path: str | Path | None = None) -> None:
    """Loads the text.

    Args:
      seq_len: Bytes per sample; at least 1.
      path: Text file to read; None for the shipped corpus.
    """
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    self.path = Path(path) if path is not None else default_text_path()
    self.data = np.frombuffer(self.path.read_bytes(), dtype=np.uint8)
    # The modulus below must be positive, i.e. at least one full (inputs, targets) window plus one.
    if self.data.size < seq_len + 2:
      raise ValueError(
        f"text {self.path} has {self.data.size} bytes; seq_len={seq_len} needs at least "
        f"{seq_len + 2}"
      )
    self.seq_len = int(seq_len)
    self.vocab_size = TEXT_VOCAB_SIZE
    self._modulus = self.data.size - self.seq_len - 1
    # Number of ids whose start `i * seq_len` is below the modulus, i.e. is not wrapped.
    self.num_samples: int | None = -(-self._modulus // self.seq_len)

  def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns int32 `(inputs, targets)` of shape `[len(ids), seq_len]`."""
    ids = _as_ids(ids)
    starts = (ids * self.seq_len) % self._modulus
    idx = starts[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)[None, :]
    windows = self.data[idx].astype(np.int32)
    return windows[:, :-1].copy(), windows[:, 1:].copy()


def default_tokens_path() -> Path:
  """Path of the shipped token file (the shipped corpus's bytes as uint16 token ids)."""
  return Path(str(importlib.resources.files("resilient_jax") / "corpus" /
                  "python_reference.u16.bin"))


def prepare_tokens(text_path: str | Path, out_path: str | Path, dtype: str = "uint16") -> Path:
  """Writes a text file's byte-level token ids as a flat binary of `dtype` (no header: the
  format nanoGPT-style preparers write, one id after another). How the shipped token file was
  made."""
  ids = np.frombuffer(Path(text_path).read_bytes(), dtype=np.uint8).astype(TOKEN_DTYPES[dtype])
  Path(out_path).write_bytes(ids.tobytes())
  return Path(out_path)


class _Windows:
  """Random access to the `(seq_len + 1)`-token window of each sample id over a token array."""

  def __init__(self, tokens: np.ndarray, seq_len: int):
    self.tokens, self.seq_len = tokens, seq_len

  def __len__(self) -> int:
    return (self.tokens.size - 1) // self.seq_len

  def __getitem__(self, i: int) -> np.ndarray:
    start = int(i) * self.seq_len
    return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)


def _read_tokens(path: Path, dtype: type, where: str) -> np.ndarray:
  """The token ids of a flat binary (memory-mapped) or an ArrayRecord file (read through grain).

  Raises:
    ValueError: a size that is not a whole number of ids, or an unreadable ArrayRecord file.
  """
  itemsize = np.dtype(dtype).itemsize
  name = np.dtype(dtype).name
  if path.suffix in (".arrayrecord", ".array_record"):
    import grain

    try:
      records = grain.sources.ArrayRecordDataSource(str(path))
      parts = [records[i] for i in range(len(records))]
    except Exception as e:  # noqa: BLE001 - any reader error is a malformed file to the user
      raise ValueError(f"{where} is not a readable ArrayRecord file: "
                       f"{str(e).splitlines()[0][:200]}") from None
    bad = next((i for i, r in enumerate(parts) if len(r) % itemsize), None)
    if bad is not None:
      raise ValueError(f"{where}: record {bad} has {len(parts[bad])} bytes, not a whole number "
                       f"of {name} token ids (train.data_dtype)")
    return np.frombuffer(b"".join(parts), dtype=dtype)
  size = path.stat().st_size
  if size % itemsize:
    raise ValueError(f"{where} has {size} bytes, not a whole number of {name} token ids "
                     "(train.data_dtype)")
  return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


class TokenSource(TokenWindows):
  """Windows over a file of token ids (uint16 or uint32), read through grain: a flat binary (the
  nanoGPT format), or an ArrayRecord file (`.arrayrecord`) whose records, in order, hold the ids
  of one stream (each record's bytes a whole number of ids, e.g. one document each).

  Sample `i` is tokens `[i * seq_len, (i + 1) * seq_len)` and its targets the same window one
  token later; ids `0 .. num_samples - 1` are the non-overlapping windows (larger ids wrap).
  The file is memory-mapped and read with `grain.MapDataset` random access by sample id, so
  which samples a step trains on stays `BatchPlan`'s pure function of `(seed, step)`, epochs
  reshuffled by seed: a re-routed micro-batch or a resumed run reads exactly the same samples.
  """

  def __init__(self, seq_len: int, vocab_size: int, path: str | Path | None = None,
               dtype: str = "uint16") -> None:
    """Opens and checks the file.

    Raises:
      ValueError: the file is missing, its size is not a whole number of `dtype` ids, it holds
        fewer than `seq_len + 2` ids, or an id that is not below `vocab_size`.
    """
    import grain

    self.path = Path(path) if path else default_tokens_path()
    where = f"train.data_path={str(self.path)!r}"
    if not self.path.is_file():
      raise ValueError(f"{where} is not a file")
    tokens = _read_tokens(self.path, TOKEN_DTYPES[dtype], where)
    if tokens.size < seq_len + 2:
      raise ValueError(f"{where} holds {tokens.size} token ids; model.seq_len={seq_len} needs "
                       f"at least {seq_len + 2}")
    top = int(tokens.max())
    if top >= vocab_size:
      raise ValueError(f"{where} holds token id {top}, not below model.vocab_size={vocab_size}")
    self.seq_len, self.vocab_size = int(seq_len), int(vocab_size)
    self._windows = grain.MapDataset.source(_Windows(tokens, self.seq_len))
    self.num_samples: int | None = len(self._windows)

  def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns int32 `(inputs, targets)` of shape `[len(ids), seq_len]`."""
    ids = _as_ids(ids)
    windows = np.stack([self._windows[int(i) % self.num_samples] for i in ids])
    return windows[:, :-1].copy(), windows[:, 1:].copy()


class Batched(Protocol):
  """What the runtime reads samples through: `num_samples` ids (None: endless) and
  `batch(ids)`, every entry of those samples stacked `[len(ids), ...]`, row k `ids[k]`'s."""

  num_samples: int | None

  def batch(self, ids: np.ndarray) -> dict[str, np.ndarray]: ...


class RecordSource:
  """A user's random-access source as the runtime reads it: anything with `len(source)` and
  `source[i]` a dict of arrays (grain's `MapDataset`, an ArrayRecord source read through grain,
  a list of dicts), or a dict of arrays with a leading samples axis. Sample `i` is always
  `source[i]`: which samples a step reads stays `BatchPlan`'s pure function of `(seed, step)`,
  so re-routing, a relaunch and a resume read the same samples.

  Raises:
    ValueError: an empty source, a sample that is not a dict of arrays, or samples whose
      entries differ in name, shape or dtype from the first's (a batch stacks them).
  """

  def __init__(self, records: Any):
    if isinstance(records, dict):
      arrays = {k: np.asarray(v) for k, v in records.items()}
      sizes = {v.shape[0] if v.ndim else None for v in arrays.values()}
      if not arrays or len(sizes) != 1 or None in sizes:
        raise ValueError("a dict of arrays as data needs every entry to share its leading "
                         f"samples axis: {_shapes(arrays)}")
      self._arrays, self._records = arrays, None
      self.num_samples: int | None = int(next(iter(sizes)))
    else:
      try:
        n = len(records)
      except TypeError:
        raise ValueError(f"the data is a {type(records).__name__}: it needs len() and "
                         "source[i] -> dict of arrays (e.g. a grain MapDataset)") from None
      self._arrays, self._records, self.num_samples = None, records, int(n)
    if not self.num_samples:
      raise ValueError("the data has no samples")
    first = self._sample(0)
    self.spec = {k: (v.shape, v.dtype) for k, v in first.items()}
    """Each entry's per-sample shape and dtype (the first sample's; every one must match)."""

  def _sample(self, i: int) -> dict[str, np.ndarray]:
    if self._arrays is not None:
      return {k: v[i] for k, v in self._arrays.items()}
    rec = self._records[int(i)]
    if not isinstance(rec, dict) or not rec:
      raise ValueError(f"data[{i}] is a {type(rec).__name__}, not a dict of arrays")
    return {str(k): np.asarray(v) for k, v in rec.items()}

  def batch(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    ids = _as_ids(ids)
    if self._arrays is not None:
      return {k: v[ids % self.num_samples] for k, v in self._arrays.items()}
    rows = [self._sample(int(i) % self.num_samples) for i in ids]
    for i, row in zip(ids.tolist(), rows, strict=True):
      spec = {k: (v.shape, v.dtype) for k, v in row.items()}
      if spec != self.spec:
        raise ValueError(f"data[{i}] has entries {_shapes(row)}, data[0] "
                         f"{ {k: f'{d}{list(s)}' for k, (s, d) in self.spec.items()} }: "
                         "every sample must have the same entries and shapes")
    return {k: np.stack([r[k] for r in rows]) for k in self.spec}


def sample_shapes(source: Batched) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Each entry of one of `source`'s samples: its shape (no samples axis) and dtype, what a
  loss is traced on."""
  one = source.batch(np.zeros(1, np.int64))
  return {k: (v.shape[1:], v.dtype) for k, v in one.items()}


def _shapes(arrays: dict) -> str:
  return "{" + ", ".join(f"{k!r}: {np.asarray(v).dtype}{list(np.shape(v))}"
                         for k, v in arrays.items()) + "}"


class BatchPlan:
  """The order in which sample ids are consumed, as a pure function of `(seed, step)`.

  Think of an endless stream of ids: epoch `e` of a finite source contributes a permutation of
  `range(num_samples)` drawn from `np.random.default_rng([seed, e])` (the identity if
  `shuffle=False`), and step `t` takes stream positions `t * global_batch .. + global_batch`, so
  a step may straddle two epochs (tail of `e`, head of `e + 1`). For an infinite source step `t`
  simply takes ids `t * global_batch .. + global_batch`.

  Nothing is stateful: the data position to checkpoint is only the step number, and any worker
  (including one that takes over a failed peer's micro-batches) can recompute any step's ids.
  """

  _CACHE_EPOCHS = 4  # a step touches at most a couple of epochs; keep a few permutations warm

  def __init__(
    self, num_samples: int | None, global_batch: int, seed: int, shuffle: bool = True
  ) -> None:
    """Creates the plan.

    Args:
      num_samples: Size of the finite id space, or None for an infinite source.
      global_batch: Ids per step (all data-parallel workers and micro-batches together).
      seed: Non-negative shuffle seed.
      shuffle: Permute each epoch; ignored for infinite sources.
    """
    if num_samples is not None and num_samples < 1:
      raise ValueError(f"num_samples must be >= 1 or None, got {num_samples}")
    if global_batch < 1:
      raise ValueError(f"train.global_batch must be >= 1, got {global_batch}")
    if seed < 0:
      raise ValueError(f"seed must be non-negative, got {seed}")
    self.num_samples = None if num_samples is None else int(num_samples)
    self.global_batch = int(global_batch)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self._perms: dict[int, np.ndarray] = {}

  @property
  def steps_per_epoch(self) -> float | None:
    """Steps per pass over the data (fractional when steps straddle epochs); None if infinite."""
    if self.num_samples is None:
      return None
    return self.num_samples / self.global_batch

  def epoch_permutation(self, epoch: int) -> np.ndarray:
    """The int64 order of ids in `epoch` (finite sources only)."""
    if self.num_samples is None:
      raise ValueError("an infinite source has no epochs")
    if epoch < 0:
      raise ValueError(f"epoch must be non-negative, got {epoch}")
    perm = self._perms.get(epoch)
    if perm is None:
      if self.shuffle:
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
      else:
        perm = np.arange(self.num_samples)
      perm = perm.astype(np.int64)
      perm.flags.writeable = False  # handed out by reference; callers must not corrupt the cache
      if len(self._perms) >= self._CACHE_EPOCHS:
        self._perms.pop(next(iter(self._perms)))
      self._perms[epoch] = perm
    return perm

  def ids_for_step(self, step: int) -> np.ndarray:
    """The int64 sample ids, length `global_batch`, consumed by 0-based `step`."""
    if step < 0:
      raise ValueError(f"step must be non-negative, got {step}")
    positions = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
    if self.num_samples is None:
      return positions
    epochs = positions // self.num_samples
    offsets = positions % self.num_samples
    ids = np.empty(self.global_batch, dtype=np.int64)
    for epoch in np.unique(epochs).tolist():
      sel = epochs == epoch
      ids[sel] = self.epoch_permutation(epoch)[offsets[sel]]
    return ids


HELD_OUT_BASE = 2**48
"""The first held-out id of an infinite (synthetic) source: training's ids count up from 0, one
per sample trained on, and never reach it."""


def held_out(num_samples: int | None, count: int) -> tuple[int | None, np.ndarray]:
  """Splits a source's ids into the ones training draws from and `count` held-out ones.

  The split is a function of the source's size and `count` alone (`count`: the samples of an
  evaluation, `train.eval_batches` steps' worth), so every layout and policy evaluates on the
  same samples and trains on the same others:

  * an infinite (synthetic) source: ids `HELD_OUT_BASE ..`, a range `BatchPlan` reaches only
    after 2**48 samples, so training is unchanged by evaluating;
  * a finite one (text, a token file): its last `count` windows, the tail of the file, as
    nanoGPT-style preparers cut their validation split. A contiguous tail rather than ids
    drawn at random: a window's neighbours continue its text, and held-out windows scattered
    among trained ones would let training read most of their context. One window before the
    tail is left out as well, since adjacent windows share a boundary token: training reads
    no token of a held-out window. `BatchPlan` then permutes the ids before the gap only, so
    turning evaluation on changes the samples training reads from a file (never with
    `count` 0).

  Args:
    num_samples: the source's ids (None: infinite).
    count: held-out samples; 0 holds nothing out.

  Returns:
    The number of ids training draws from (None: infinite), and the held-out ids (int64).

  Raises:
    ValueError: a finite source with fewer than `count + 2` windows.
  """
  if count < 0:
    raise ValueError(f"held-out samples must be >= 0, got {count}")
  if num_samples is None:
    return None, HELD_OUT_BASE + np.arange(count, dtype=np.int64)
  if not count:
    return num_samples, np.zeros(0, np.int64)
  if num_samples < count + 2:
    raise ValueError(f"the data has {num_samples} samples: holding out {count} leaves none to "
                     "train on")
  return num_samples - count - 1, np.arange(num_samples - count, num_samples, dtype=np.int64)


def sample_digest(ids: np.ndarray) -> str:
  """A 16-hex-char fingerprint of a set of sample ids, insensitive to their order.

  Two batches get the same digest iff they hold the same ids (as a multiset), up to sha256
  collisions on the 64-bit prefix.
  """
  arr = np.sort(np.asarray(ids).astype("<i8").ravel())  # fixed endianness: portable digests
  return hashlib.sha256(arr.tobytes()).hexdigest()[:16]


def make_source(kind: str, *, vocab_size: int, seq_len: int, seed: int, path: str = "",
                dtype: str = "uint16") -> DataSource:
  """Builds a data source from config values.

  Args:
    kind: "synthetic", "text" or "tokens".
    vocab_size: The model's vocabulary size; the text source needs at least 256.
    seq_len: Tokens per sample.
    seed: Seed of the synthetic source (the text source has no randomness).
    path, dtype: the token file of "tokens" ("": the shipped one) and its id type.

  Returns:
    The source.
  """
  if kind == "synthetic":
    return SyntheticSource(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
  if kind == "text":
    if vocab_size < TEXT_VOCAB_SIZE:
      raise ValueError(
        f"data source 'text' is byte-level and needs model.vocab_size >= {TEXT_VOCAB_SIZE}, "
        f"got {vocab_size}"
      )
    return TextSource(seq_len=seq_len)
  if kind == "tokens":
    return TokenSource(seq_len, vocab_size, path or None, dtype)
  raise ValueError(f"unknown data source {kind!r}; choose one of {', '.join(SOURCE_KINDS)}")


def split_microbatches(ids: np.ndarray, dp: int, microbatches: int) -> np.ndarray:
  """Splits one step's ids into the global micro-batches, `[dp * microbatches, mb_size]`.

  Micro-batch `j` gets `ids[j * mb_size:(j + 1) * mb_size]`, and pipeline `d` owns micro-batches
  `d * microbatches .. d * microbatches + microbatches - 1`, matching the schedule's numbering.

  Args:
    ids: One step's sample ids, length `train.global_batch`.
    dp: Data-parallel width (`mesh.dp`).
    microbatches: Micro-batches per pipeline (`pipeline.microbatches`).

  Returns:
    The int64 id matrix; row j is micro-batch j.
  """
  ids = np.asarray(ids, dtype=np.int64)
  if ids.ndim != 1:
    raise ValueError(f"sample ids must be 1-D, got shape {ids.shape}")
  if dp < 1 or microbatches < 1:
    raise ValueError(
      f"mesh.dp and pipeline.microbatches must be >= 1, got mesh.dp={dp}, "
      f"pipeline.microbatches={microbatches}"
    )
  total = dp * microbatches
  if ids.size == 0 or ids.size % total:
    raise ValueError(
      f"train.global_batch={ids.size} must be a positive multiple of "
      f"mesh.dp * pipeline.microbatches = {dp} * {microbatches} = {total}"
    )
  return ids.reshape(total, ids.size // total)
