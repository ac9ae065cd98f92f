"""``--model.fp8``: which products become float8, that weights and checkpoints do not change, and the one-line
refusals. torchao's float8 products run on a CPU too (slowly), so the conversion is checked here; its speed and loss
on a GPU are measured by ``benchmarks/gpu_suite.py``'s ``fp8`` step."""

from __future__ import annotations

import sys
from unittest.mock import Mock

import lightning as L
import pytest
import torch
from conftest import tiny_config
from lightning.pytorch.strategies import DeepSpeedStrategy

from torch_handle.data import PAD_ID
from torch_handle.errors import SetupError
from torch_handle.model import Transformer
from torch_handle.module import Seq2SeqModule
from torch_handle.parallel import ParallelPlan, apply_float8, check_float8

pytest.importorskip("torchao")
pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 40
DEVICE_LINE = (
    "--model.fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
    "Blackwell), this run has a CPU: leave --model.fp8 off"
)


def _batch() -> dict[str, torch.Tensor]:
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD_ID, PAD_ID]])
    return {"src": src, "tgt": torch.tensor([[1, 11, 12, 13, 2], [1, 14, 2, PAD_ID, PAD_ID]])}


def test_float8_makes_every_layer_product_but_cross_attention_inputs_a_float8_product() -> None:
    torch.manual_seed(0)
    config = tiny_config(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, gated_ff=True, activation="silu")
    model, reference = Transformer(config), Transformer(config)
    reference.load_state_dict(model.state_dict())
    apply_float8(model)
    float8 = {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}
    layer = ("self_attn.in_proj", "self_attn.out_proj", "ff.linear1", "ff.linear2", "ff.gate")
    assert float8 == {f"encoder_layers.0.{name}" for name in layer} | {
        f"decoder_layers.0.{name}" for name in (*layer, "cross_attn.out_proj")
    }
    # Same parameters, same names: checkpoints and exports of a float8 run load into a plain model.
    assert {k: v.dtype for k, v in model.state_dict().items()} == {
        k: v.dtype for k, v in reference.state_dict().items()
    }
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())

    ran: list[str] = []  # every float8 module's own forward runs, self-attention's packed projection included
    for name, module in model.named_modules():
        if name in float8:
            module.register_forward_hook(lambda *_, name=name: ran.append(name))
    batch = _batch()
    logits = model(batch["src"], batch["tgt"][:, :-1])
    assert sorted(ran) == sorted(float8)
    expected = reference(batch["src"], batch["tgt"][:, :-1])
    error = ((logits - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.1  # float8's rounding, not another function
    logits.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)


def test_fp8_on_a_cpu_is_one_line_before_the_first_step() -> None:
    module = Seq2SeqModule(tiny_config(), vocab_size=VOCAB, fp8=True)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(SetupError) as raised:
        trainer.fit(module, train_dataloaders=[_batch()])
    assert str(raised.value) == DEVICE_LINE
    assert module.global_step == 0


@pytest.mark.parametrize(
    ("plan", "strategy", "refused"),
    [
        (Mock(spec=ParallelPlan, tensor_parallel_size=2, pipeline_size=1), None, "tensor parallelism"),
        (Mock(spec=ParallelPlan, tensor_parallel_size=1, pipeline_size=2), None, "pipeline parallelism"),
        (ParallelPlan(), Mock(spec=DeepSpeedStrategy), "DeepSpeed's ZeRO"),
        (ParallelPlan(), Mock(), None),
    ],
)
def test_fp8_names_what_it_does_not_combine_with_in_one_line(
    plan: ParallelPlan, strategy: Mock | None, refused: str | None
) -> None:
    module = Seq2SeqModule(tiny_config(), vocab_size=VOCAB, fp8=True)
    module._trainer = Mock(strategy=strategy or Mock())
    assert module._float8_refused(plan) == refused
    if refused is None:
        return
    with pytest.raises(SetupError) as raised:
        check_float8(torch.device("cuda"), refused)
    assert str(raised.value) == (
        f"--model.fp8 does not combine with {refused}: torchao's float8 linears need tensor-parallel styles and "
        "weight handling of their own; train in float8 with ddp, fsdp or fsdp2 (ModelParallelStrategy without "
        "tensor or pipeline parallelism), or leave --model.fp8 off"
    )


def test_test_and_predict_decode_without_float8() -> None:
    """Only fit converts: a module tested with fp8 set decodes with its plain linear layers (here on a CPU, where
    fitting would refuse)."""
    module = Seq2SeqModule(tiny_config(), vocab_size=VOCAB, fp8=True)
    module._trainer = Mock(state=Mock(fn="test"))
    assert not module._plan().float8
    module._trainer = Mock(state=Mock(fn="fit"))
    assert module._plan().float8


def test_fp8_without_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # a Hopper GPU
    check_float8(torch.device("cuda"))  # torchao is installed here: nothing to refuse
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if it were not
    with pytest.raises(SetupError, match=r"^--model.fp8 needs torchao: pip install 'torch-handle\[fp8\]'$"):
        check_float8(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(SetupError, match=r"this run has compute capability 8.0: leave --model.fp8 off$"):
        check_float8(torch.device("cuda"))
