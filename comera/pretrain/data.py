"""Token blocks, batch order and masked-language-model masking.

Everything random here is a pure function of ``(seed, step)``: the batch of
step ``s`` and its mask are the same whether the run went straight to ``s``
or was resumed on the way, so a checkpoint only needs the step number.
"""
import hashlib

import torch

from comera.pretrain.tokenizer import BOS, MASK

NUM_SPECIAL = 5


def make_blocks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cuts a token stream into ``(n, seq_len)`` blocks, each ``<s>`` then
    ``seq_len - 1`` consecutive tokens (the tail that does not fill a block
    is dropped).

    Example:
        >>> make_blocks(torch.arange(10, 17), 4)
        tensor([[ 0, 10, 11, 12],
                [ 0, 13, 14, 15]])
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    body = seq_len - 1
    n = ids.numel() // body
    if n == 0:
        return torch.zeros(0, seq_len, dtype=torch.long)
    out = torch.empty(n, seq_len, dtype=torch.long)
    out[:, 0] = BOS
    out[:, 1:] = ids[: n * body].reshape(n, body).long()
    return out


def seed_for(*parts) -> int:
    """A 63-bit seed derived from the parts (stable across runs and machines)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class BatchOrder:
    """Which blocks form the batch of each step: every epoch is a fresh
    seeded permutation of all blocks, read in order.

    Example:
        >>> order = BatchOrder(num_blocks=5, batch_size=2, seed=0)
        >>> sorted(order.indices(0).tolist() + order.indices(1).tolist()
        ...        + order.indices(2).tolist()[:1])
        [0, 1, 2, 3, 4]
    """

    def __init__(self, num_blocks: int, batch_size: int, seed: int):
        if num_blocks < 1:
            raise ValueError("no training blocks: the training split is shorter than one sequence")
        self.n, self.bs, self.seed = num_blocks, batch_size, seed
        self._epoch, self._perm = None, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(seed_for(self.seed, "epoch", epoch))
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def indices(self, step: int) -> torch.Tensor:
        out = []
        for pos in range(step * self.bs, (step + 1) * self.bs):
            out.append(int(self._permutation(pos // self.n)[pos % self.n]))
        return torch.tensor(out, dtype=torch.long)

    def epoch(self, step: int) -> float:
        return step * self.bs / self.n


def mask_tokens(blocks: torch.Tensor, vocab_size: int, generator: torch.Generator,
                prob: float = 0.15):
    """BERT masking: ``prob`` of the ordinary tokens are chosen; of those 80%
    become ``<mask>``, 10% a random ordinary token and 10% stay.  Returns
    ``(inputs, labels)`` with labels -100 where nothing is predicted.  At
    least one token per batch is chosen, so the loss is always defined.

    Example:
        >>> x = torch.randint(5, 100, (4, 64))
        >>> inp, lab = mask_tokens(x, 100, torch.Generator().manual_seed(0))
        >>> bool(((lab == -100) | (lab == x)).all()), bool((inp[lab == -100] == x[lab == -100]).all())
        (True, True)
    """
    special = blocks < NUM_SPECIAL
    chosen = (torch.rand(blocks.shape, generator=generator) < prob) & ~special
    if not chosen.any():
        candidates = torch.nonzero(~special.flatten()).flatten()
        if candidates.numel() == 0:
            raise ValueError("a batch with only special tokens cannot be masked")
        pick = candidates[torch.randint(candidates.numel(), (1,), generator=generator)]
        chosen.view(-1)[pick] = True
    labels = torch.where(chosen, blocks, torch.full_like(blocks, -100))
    u = torch.rand(blocks.shape, generator=generator)
    random_tokens = torch.randint(NUM_SPECIAL, vocab_size, blocks.shape, generator=generator)
    inputs = blocks.clone()
    inputs[chosen & (u < 0.8)] = MASK
    swap = chosen & (u >= 0.8) & (u < 0.9)
    inputs[swap] = random_tokens[swap]
    return inputs, labels


class MLMData:
    """Training and validation blocks with their batch order and masks."""

    def __init__(self, train_ids, valid_ids, *, seq_len: int, batch_size: int, vocab_size: int,
                 valid_blocks: int, seed: int):
        self.train = make_blocks(train_ids, seq_len)
        valid = make_blocks(valid_ids, seq_len)[:valid_blocks]
        if self.train.shape[0] == 0:
            raise ValueError(f"the training split has {train_ids.numel()} tokens, fewer than one "
                             f"sequence of seq_len={seq_len}; use a larger corpus or a smaller --seq-len")
        if valid.shape[0] == 0:
            raise ValueError(f"the validation split has {valid_ids.numel()} tokens, fewer than one "
                             f"sequence of seq_len={seq_len}; use a larger corpus, a larger "
                             "--valid-fraction or a smaller --seq-len")
        self.seed, self.vocab_size, self.batch_size = seed, vocab_size, batch_size
        self.order = BatchOrder(self.train.shape[0], batch_size, seed)
        # One fixed mask for validation: every evaluation of every method
        # scores the same predictions.
        g = torch.Generator().manual_seed(seed_for(seed, "valid"))
        self.valid_inputs, self.valid_labels = mask_tokens(valid, vocab_size, g)

    def batch(self, step: int):
        """``(inputs, labels)`` of training step ``step`` (0-based)."""
        blocks = self.train[self.order.indices(step)]
        g = torch.Generator().manual_seed(seed_for(self.seed, "mask", step))
        return mask_tokens(blocks, self.vocab_size, g)

    def valid_batches(self, batch_size: int):
        for i in range(0, self.valid_inputs.shape[0], batch_size):
            yield self.valid_inputs[i:i + batch_size], self.valid_labels[i:i + batch_size]

    def describe(self) -> dict:
        return {"train_blocks": int(self.train.shape[0]), "valid_blocks": int(self.valid_inputs.shape[0]),
                "valid_masked_tokens": int((self.valid_labels != -100).sum())}
