"""Turn a traced stage into the stage IR contract: named I/O, beam_idx Gather, stateful KV.

The ``beam_idx`` parameter with ``Gather(ReadValue, beam_idx, 0)`` on every KV state is what
OpenVINO's fused stateful attention (CPU stateful SDPA fusion, GPU IndirectKVCache) looks for;
without it a split model loses those kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import openvino as ov
import torch
from openvino import opset13 as ops

from agent.export.stage_module import HeadPart, StageModule


def kv_names(layers: range) -> tuple[list[str], list[str]]:
    ins, outs = [], []
    for i in layers:
        for kind in ("key", "value"):
            ins.append(f"past_key_values.{i}.{kind}")
            outs.append(f"present.{i}.{kind}")
    return ins, outs


def convert_stage(module: StageModule, config: Any, *, beam_idx: bool = True) -> ov.Model:
    """Trace ``module`` and return the stateful OpenVINO model for that stage."""
    spec = module.spec
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kvh = config.num_key_value_heads
    n, past = 3, 2
    if spec.first:
        main = torch.ones((1, n), dtype=torch.int64)
        main_name = "input_ids"
    else:
        main = torch.zeros((1, n, config.hidden_size), dtype=torch.float32)
        main_name = "hidden_states"
    example: list[torch.Tensor] = [
        main,
        torch.ones((1, past + n), dtype=torch.int64),
        torch.arange(past, past + n, dtype=torch.int64)[None, :],
    ]
    names = [main_name, "attention_mask", "position_ids"]
    if spec.last and not module.full_logits:
        example.append(torch.arange(n, dtype=torch.int64))
        names.append("logits_idx")
    kv_in, kv_out = kv_names(spec.layers)
    for _ in kv_in:
        example.append(torch.zeros((1, kvh, past, hd), dtype=torch.float32))
    names += kv_in

    with torch.no_grad():
        model = ov.convert_model(module, example_input=tuple(example))

    for port, name in zip(model.inputs, names, strict=True):
        port.get_tensor().set_names({name})
        # GenAI's PagedAttention rewrite (SDPAToPagedAttention) finds inputs by node name.
        port.get_node().set_friendly_name(name)
    if not spec.last:
        out_names = ["hidden_states_out"]
    elif module.full_logits:
        out_names = ["logits"]
    else:
        out_names = ["logits", "token_ids"] + (["hidden_states_out"] if module.hidden_out else [])
    out_names += kv_out
    for port, name in zip(model.outputs, out_names, strict=True):
        port.get_tensor().set_names({name})

    # Dynamic shapes: batch, new tokens, total slots, cached slots.
    shapes: dict[str, ov.PartialShape] = {
        main_name: ov.PartialShape([-1, -1] if spec.first else [-1, -1, config.hidden_size]),
        "attention_mask": ov.PartialShape([-1, -1]),
        "position_ids": ov.PartialShape([-1, -1]),
    }
    if "logits_idx" in names:
        shapes["logits_idx"] = ov.PartialShape([-1])
    for name in kv_in:
        shapes[name] = ov.PartialShape([-1, kvh, -1, hd])
    model.reshape(shapes)

    _fast_argmax(model)
    if beam_idx:
        _fuse_beam_idx(model, kv_in)
    _make_stateful(model, kv_in, kv_out, main_name)
    model.set_rt_info("lakeshard", ["framework"])
    return model


def convert_head(module: HeadPart, config: Any) -> ov.Model:
    """Trace a head part: ``hidden_states`` [B, n, H] -> ``top_values``, ``top_ids`` [B, n] (stateless)."""
    with torch.no_grad():
        model = ov.convert_model(module, example_input=(torch.zeros((1, 3, config.hidden_size), dtype=torch.float32),))
    model.inputs[0].get_tensor().set_names({"hidden_states"})
    model.inputs[0].get_node().set_friendly_name("hidden_states")
    for port, name in zip(model.outputs, ("top_values", "top_ids"), strict=True):
        port.get_tensor().set_names({name})
    model.reshape({"hidden_states": ov.PartialShape([-1, -1, config.hidden_size])})
    _fast_argmax(model)
    model.set_rt_info("lakeshard", ["framework"])
    return model


def _fast_argmax(model: ov.Model) -> None:
    """torch.argmax converts to a *stable*, sorted TopK, which the CPU plugin runs about 7x
    slower over a 152k vocabulary (0.9 ms vs 0.13 ms a token). k=1 needs neither."""
    for op in model.get_ops():
        if op.get_type_name() != "TopK":
            continue
        attrs = op.get_attributes()
        k, axis, idx_type = op.input_value(1), attrs["axis"], attrs["index_element_type"]
        fast = ops.topk(op.input_value(0), k, axis, attrs["mode"], "none", idx_type, False)
        for i in range(2):
            for target in op.output(i).get_target_inputs():
                target.replace_source_output(fast.output(i))
    model.validate_nodes_and_infer_types()


def _fuse_beam_idx(model: ov.Model, kv_in: list[str]) -> None:
    beam = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    beam.set_friendly_name("beam_idx")
    model.add_parameters([beam])
    for name in kv_in:
        port = model.input(name)
        consumers = port.get_target_inputs()
        gather = ops.gather(port, beam, ops.constant(np.int64(0)))
        for c in consumers:
            c.replace_source_output(gather.output(0))
    model.validate_nodes_and_infer_types()


def _make_stateful(model: ov.Model, kv_in: list[str], kv_out: list[str], main_name: str) -> None:
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(model, dict(zip(kv_in, kv_out, strict=True)))
    # Initialise every state as an empty [batch, heads, 0, head_dim] tensor, batch taken from
    # the main input, so a fresh request (or reset_state) starts from an empty cache.
    batch = ops.gather(ops.shape_of(model.input(main_name), output_type="i64"), ops.constant([0]), ops.constant(0))
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        dims: list[Any] = []
        for d, dim in enumerate(op.get_output_partial_shape(0)):
            if d == 0:
                dims.append(batch)
            else:
                dims.append(ops.constant(np.array([dim.get_length() if dim.is_static else 0], dtype=np.int64)))
        zero = ops.constant(np.array(0.0, dtype=np.float32))
        op.set_arguments([ops.broadcast(zero, ops.concat(dims, axis=0))])
    model.validate_nodes_and_infer_types()
