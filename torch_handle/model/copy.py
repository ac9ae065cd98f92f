"""Copy attention, as OpenNMT's ``CopyGenerator`` (See et al., 2017, "Get To The Point"): each next token is drawn from
the vocabulary or copied from the source, mixed by a learned gate. The source and target share one vocabulary, so a
copied position adds its probability to its own token's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CopyHead(nn.Module):
    """Bilinear attention over the encoder's output (Luong's "general", OpenNMT's default) and a sigmoid gate."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.query = nn.Linear(d_model, d_model, bias=False)
        self.gate = nn.Linear(d_model, 1)
        self.scale = d_model**-0.5

    def forward(self, hidden: Tensor, logits: Tensor, memory: Tensor, memory_padding: Tensor, source: Tensor) -> Tensor:
        """Log-probabilities ``(R, T, V)`` of the mixture, from the decoder's last states ``hidden (R, T, C)`` and
        their vocabulary ``logits (R, T, V)``; ``memory (M, S, C)``, its padding and the ``source (M, S)`` ids hold a
        row for each row of ``hidden`` or for each group of consecutive rows (a source's beams)."""
        rows, length, _ = hidden.shape
        m, s = source.shape
        query = self.query(hidden).reshape(m, -1, hidden.shape[-1])  # (M, g*T, C)
        scores = torch.bmm(query, memory.transpose(1, 2)).float() * self.scale  # (M, g*T, S)
        attention = scores.masked_fill(memory_padding[:, None, :], float("-inf")).softmax(dim=-1)
        gate = self.gate(hidden).float()  # (R, T, 1): log-odds of copying
        copied = attention.view(rows, length, s) * torch.sigmoid(gate)
        index = source.repeat_interleave(rows // m, dim=0)[:, None, :].expand(rows, length, s)
        mass = torch.zeros(rows, length, logits.shape[-1], device=logits.device).scatter_add_(-1, index, copied)
        # log(0) where nothing is copied, without a NaN gradient through it
        some = mass > 0
        log_mass = torch.where(some, torch.log(torch.where(some, mass, 1.0)), float("-inf"))
        return torch.logaddexp(F.log_softmax(logits.float(), dim=-1) + F.logsigmoid(-gate), log_mass)
