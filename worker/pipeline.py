"""Pipeline parallelism inside one model: which decoder layers a stage holds, placeholders for the
modules other stages hold, and the hand-off of the hidden stream between stages.

Rules:
- Stage s of P holds a contiguous slice of the decoder layers; when the layers do not divide evenly, the
  first stages take one more each (the last stage also runs the final norm, the LM head and sampling).
  The first stage holds the embedding, the last the final norm and the LM head.
- A module a stage does not hold is a ``MissingLayer``: no parameters, so nothing of it is allocated or
  loaded (checkpoint names that lead into it resolve to nothing and are skipped).
- Between stages travels the decoder's ``(hidden, residual)`` pair, stacked into one ``[2, tokens, hidden]``
  tensor: the next stage continues with exactly the values a single-stage model would have, so tokens
  are bit-for-bit those of PP = 1. The receiver knows the shape from the step's token count.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.parallel_state import pp_group, pp_recv, pp_send


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The decoder layers of `stage` (see the module rules)."""
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def local_layers(num_layers: int) -> range:
    """The decoder layers this process's stage holds (all of them without PP)."""
    pp = pp_group()
    return stage_layers(num_layers, pp.stage, pp.size)


class MissingLayer(nn.Module):
    """Stands in for a module that another pipeline stage holds."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


class StageLink:
    """Receives the hidden stream from the previous stage and sends it on to the next one. A send runs
    in the background while the stage computes its next step; it is waited for before the next send."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._sending = None

    def receive(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        pp_recv(buf, pp_group().stage - 1)
        return buf[0], buf[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.wait()
        buf = torch.stack([hidden, residual])
        self._sending = (pp_send(buf, pp_group().stage + 1), buf)

    def wait(self) -> None:
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None
