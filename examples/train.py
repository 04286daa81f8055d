"""Precompile a training step, save it, and train from the loaded artifact.

Captured with grad enabled and parameters that require grad, the pipeline
builds a *training* artifact: Inductor compiles the forward and the backward
of AOTAutograd's joint graph, and both travel in the saved file. Loaded with
``model=``, the artifact computes with that module's parameters, so its
gradients land on them and any optimizer trains it.

This script trains the reference transformer on a toy next-token task twice
from the same initial weights, once through the loaded artifact and once in
eager PyTorch, and prints both losses side by side.

Run from the repository root: ``python examples/train.py [steps]``. Exits
non-zero if a loss differs from eager's by more than 1e-4 (relative).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fixtures.models import TinyTransformer
from torch_precompile import Precompile

TOLERANCE = 1e-4


def make_model() -> TinyTransformer:
    """The reference transformer (2 blocks, d=256) in train mode, seed 0."""
    torch.manual_seed(0)
    return TinyTransformer().train()


def toy_batch(
    batch: int = 2, seq: int = 32, vocab: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences (t, t+1, t+2, ...): the target is the next token."""
    starts = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(1))
    tokens = (starts + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main(steps: int = 10) -> int:
    ids, targets = toy_batch()

    # 1. Capture with grad enabled: a training artifact (forward + backward).
    t = time.perf_counter()
    model = make_model()
    captured = Precompile.dynamo(model, ids)
    joint = Precompile.aot_autograd(captured)
    compiled = Precompile.inductor(joint)
    artifact = Precompile.precompile(compiled)
    print(
        f"precompiled a {'training' if artifact.training else 'inference'} artifact "
        f"in {time.perf_counter() - t:.1f} s (compiled graphs: {', '.join(compiled.source_code)})"
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "transformer_train.pt2")
        Precompile.save(path, artifact, captured.bytecode, compiled.guards)
        print(f"saved {os.path.getsize(path) / 2**20:.1f} MiB to {path}")

        # 2. Load bound to a fresh model: gradients land on its parameters.
        trained = make_model()
        t = time.perf_counter()
        loaded = Precompile.load(path, model=trained)
        print(f"loaded in {time.perf_counter() - t:.2f} s")

    # 3. Train through the artifact and, from the same weights, in eager PyTorch.
    eager = make_model()
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    worst = 0.0
    print(f"{'step':>4}  {'artifact loss':>13}  {'eager loss':>10}")
    for step in range(steps):
        loss = lm_loss(loaded(ids), targets)  # the loss is computed outside the artifact
        opt.zero_grad()
        loss.backward()  # runs the compiled backward
        opt.step()

        eager_loss = lm_loss(eager(ids), targets)
        eager_opt.zero_grad()
        eager_loss.backward()
        eager_opt.step()

        worst = max(worst, abs(loss.item() - eager_loss.item()) / abs(eager_loss.item()))
        print(f"{step:>4}  {loss.item():>13.6f}  {eager_loss.item():>10.6f}")

    ok = worst <= TOLERANCE
    print(f"train.py: max relative loss difference {worst:.1e} ({'OK' if ok else 'FAIL'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10))
