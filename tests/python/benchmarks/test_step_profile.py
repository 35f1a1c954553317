"""The step profile's categoriser: on a real trace of the tiny train step captured on CPU (the
Pallas kernel interpreted, remat recomputing the forward), and its rules on hand-written ops."""

import dataclasses

import jax
import numpy as np
import pytest
import step_profile
import train_step
from step_profile import (
    ATTENTION_BACKWARD,
    ATTENTION_FORWARD,
    ATTENTION_RECOMPUTED,
    COLLECTIVES,
    ELEMENTWISE,
    HOST_IDLE,
    LM_HEAD_LOSS,
    MATMULS,
    OPTIMIZER,
    HloOp,
    OpEvent,
)

from kiln.train.mesh import make_mesh
from kiln.train.optimizer import AdamConfig
from kiln.train.step import ModelOptions, init_train_state, make_train_step, shard_batch

# The benchmark's tiny model with one layer: the interpreted kernel's compile dominates the test.
CONFIG = dataclasses.replace(train_step.MODELS["tiny"], num_layers=1)


def test_a_cpu_trace_of_the_tiny_step_is_split_by_named_scope(tmp_path):
    mesh, adam = make_mesh({"data": -1}), AdamConfig()
    options = ModelOptions(attention="pallas", remat="full")
    state = init_train_state(CONFIG, adam, 2, seed=0, mesh=mesh, options=options)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 32), dtype=np.int32)
    segments = np.repeat(np.array([[0] * 20 + [1] * 12]), 2, axis=0).astype(np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones((2, 32), np.float32), "segment_ids": segments}
    step = make_train_step(adam, 2, z_loss_weight=1e-4, mesh=mesh)
    batch = shard_batch(batch, mesh)

    xplane, wall_ns = step_profile.capture(
        lambda: jax.block_until_ready(step(state, batch)), tmp_path
    )
    events = step_profile.read_op_events(xplane)

    kernels = {"kiln_flash_attention_fwd", "kiln_flash_attention_dkv", "kiln_flash_attention_dq"}
    by_kernel = {
        kernel: {e.category for e in events if kernel in e.op_name} for kernel in kernels
    }
    # The interpreted kernel's ops carry the attention scope: the forward kernel runs in the
    # forward pass and again under remat, the dK/dV and dQ kernels in the backward pass.
    assert by_kernel["kiln_flash_attention_fwd"] == {ATTENTION_FORWARD, ATTENTION_RECOMPUTED}
    assert by_kernel["kiln_flash_attention_dkv"] == {ATTENTION_BACKWARD}
    assert by_kernel["kiln_flash_attention_dq"] == {ATTENTION_BACKWARD}
    split = step_profile.step_split(events, steps=1, wall_ns=wall_ns)
    for category in (MATMULS, LM_HEAD_LOSS, OPTIMIZER, ELEMENTWISE, HOST_IDLE):
        assert split[category] > 0, (category, split)
    assert split[COLLECTIVES] == 0  # one CPU device
    assert sum(split.values()) == pytest.approx(wall_ns / 1e6)


@pytest.mark.parametrize(
    ("op", "category"),
    [
        (HloOp("fusion", "jit(train_step)/jvp(kiln_attention)/pallas_call"), ATTENTION_FORWARD),
        (
            HloOp("custom-call", "jit(train_step)/transpose(jvp(jvp()))/checkpoint/"
                  "rematted_computation/kiln_attention/jit(flash_attention)/pallas_call"),
            ATTENTION_RECOMPUTED,
        ),
        (
            HloOp("custom-call", "jit(train_step)/transpose(jvp(jvp()))/checkpoint/"
                  "kiln_attention/jit(flash_attention)/pallas_call", "__gpu$xla.gpu.triton"),
            ATTENTION_BACKWARD,
        ),
        # The lm head's matmul is the loss's; the optimizer's reductions are the optimizer's.
        (HloOp("dot", "jit(train_step)/jvp(kiln_lm_head_loss)/dot_general"), LM_HEAD_LOSS),
        (HloOp("fusion", "jit(train_step)/kiln_optimizer/reduce_sum"), OPTIMIZER),
        (HloOp("custom-call", "jit(train_step)/jvp()/dot_general", "__cublas$lt$matmul"), MATMULS),
        (HloOp("fusion", "jit(train_step)/jvp()/dot_general", contains_matmul=True), MATMULS),
        (HloOp("all-gather-start", "jit(train_step)/jvp()/all_gather"), COLLECTIVES),
        (HloOp("fusion", "jit(train_step)/jvp()/mul"), ELEMENTWISE),
        (HloOp("", ""), ELEMENTWISE),  # an op the trace's HLO does not name
    ],
)
def test_rules(op, category):
    assert step_profile.categorise(op) == category


def test_overlapping_ops_share_their_time_and_loops_count_only_alone():
    events = [
        OpEvent(0, 100, MATMULS),
        OpEvent(50, 150, ELEMENTWISE),  # overlaps the matmul by 50 ns: 25 each
        OpEvent(200, 400, ATTENTION_FORWARD, container=True),  # a while loop around a kernel
        OpEvent(250, 350, MATMULS),  # inside the loop: its 100 ns are the kernel's
    ]
    assert step_profile.split_by_category(events) == {
        MATMULS: 75 + 100,
        ELEMENTWISE: 75,
        ATTENTION_FORWARD: 100,
    }
    split = step_profile.step_split(events, steps=2, wall_ns=1000)
    assert split[HOST_IDLE] == pytest.approx((1000 - 350) / 2 / 1e6)
    assert sum(split.values()) == pytest.approx(1000 / 2 / 1e6)


def test_on_cpu_the_wait_within_a_run_is_the_op_before_it():
    dot = OpEvent(0, 10, MATMULS, hlo_op="dot.3")
    add = OpEvent(30, 40, ELEMENTWISE, hlo_op="add_fusion.1")  # waited 20 ns for the dot
    next_step = OpEvent(60, 70, OPTIMIZER, hlo_op="reduce.2")  # 10 ns of host time between runs
    runs = [(0, 50), (55, 70)]
    tails = step_profile.cpu_async_tails([add, next_step, dot], runs)
    assert tails == [
        OpEvent(10, 30, MATMULS, hlo_op="dot.3"),
        OpEvent(40, 50, ELEMENTWISE, hlo_op="add_fusion.1"),
        OpEvent(55, 60, ELEMENTWISE, hlo_op="add_fusion.1"),
    ]


def test_a_gpu_trace_is_read_from_its_device_plane(tmp_path):
    """An XSpace as XLA:GPU writes one: kernels on a device stream line with the stats its kernel
    annotation gives (hlo_op, program_id, and the op's name), host events beside them, and the
    module's HLO proto in the metadata plane."""
    attention = "jit(train_step)/transpose(jvp(jvp()))/checkpoint/kiln_attention/pallas_call"
    hlo = _message(
        (1, _message(  # HloProto.hlo_module
            (1, "jit_train_step"),
            (3, _message(  # a fused computation: a dot at its root
                (1, "fused_dot"), (5, 2), (6, 20),
                (2, _message((1, "dot.1"), (2, "dot"), (35, 20))),
            )),
            (3, _message(  # the entry computation
                (1, "main"), (5, 1), (6, 11),
                (2, _message((1, "gemm_fusion.1"), (2, "fusion"), (35, 10), (38, _packed(2)))),
                (2, _message((1, "custom-call.3"), (2, "custom-call"), (35, 11),
                             (7, _message((2, attention))), (28, "__gpu$xla.gpu.triton"))),
            )),
        )),
    )  # fmt: skip
    stats = ["hlo_op", "program_id", "hlo_module", "name", "Hlo Proto"]
    kernels = [  # (start ns, duration ns, hlo_op, annotation's name)
        (0, 300, "gemm_fusion.1", "dot_general"),
        (300, 100, "custom-call.3", "transpose(jvp(jvp()))/checkpoint/kiln_attention"),
        (500, 100, "loop_fusion.9", "jvp(kiln_optimizer)/mul"),  # not in the HLO proto
    ]
    device = _plane(1, "/device:GPU:0", stats, [
        _line("Stream #13", [_event(1, start, duration, {0: op, 1: 7, 2: "jit_train_step",
                                                         3: name})
                             for start, duration, op, name in kernels]),
    ])  # fmt: skip
    second_device = _plane(4, "/device:GPU:1", stats, [
        _line("Stream #13", [_event(1, 0, 200, {0: "gemm_fusion.1", 1: 7})]),
    ])  # fmt: skip
    host = _plane(2, "/host:CPU", stats, [  # the launches: not the device's time
        _line("tf_XLAGpuClient", [_event(1, 0, 50, {0: "gemm_fusion.1", 1: 7})]),
    ])
    metadata = _plane(3, "/host:metadata", stats, [], hlo_protos={"jit_train_step(7)": (7, hlo)})
    path = tmp_path / "gpu.xplane.pb"
    path.write_bytes(_message((1, device), (1, host), (1, metadata), (1, second_device)))

    events = step_profile.read_op_events(path)
    assert [(e.device, e.category, e.named) for e in events] == [
        ("/device:GPU:0", MATMULS, True), ("/device:GPU:0", ATTENTION_BACKWARD, True),
        ("/device:GPU:0", OPTIMIZER, False), ("/device:GPU:1", MATMULS, True),
    ]  # fmt: skip
    split = step_profile.step_split(events, steps=1, wall_ns=1000)  # the two GPUs' mean
    assert split[MATMULS] == pytest.approx((300 + 200) / 2 / 1e6)
    assert split[ATTENTION_BACKWARD] == pytest.approx(100 / 2 / 1e6)
    assert split[HOST_IDLE] == pytest.approx((1000 - 350) / 1e6)
    assert "0.00 ms/step in ops missing from the trace's HLO (loop_fusion.9)" in (
        step_profile.unnamed_note(events, steps=1)
    )


def test_a_tpu_trace_is_read_from_its_cores_ops_line(tmp_path):
    """An XSpace as the TPU runtime writes one: on the core's plane, "XLA Ops" events named by
    their HLO text and no hlo_op stat, the executable's run on "XLA Modules" around them, and
    "Async XLA Ops" (copies overlapping the ops), which are not busy time."""
    attention = "jit(train_step)/transpose(jvp(jvp()))/checkpoint/kiln_attention/pallas_call"
    hlo = _message(
        (1, _message(
            (1, "jit_train_step"),
            (3, _message(
                (1, "main"), (5, 1), (6, 11),
                (2, _message((1, "convolution.1"), (2, "convolution"), (35, 10))),
                (2, _message((1, "custom-call.3"), (2, "custom-call"), (35, 11),
                             (7, _message((2, attention))), (28, "tpu_custom_call"))),
            )),
        )),
    )  # fmt: skip
    names = {
        10: "jit_train_step(7)",
        11: "%convolution.1 = bf16[8,128]{1,0} convolution(bf16[8,64]{1,0} %p0, ...)",
        12: "%custom-call.3 = (bf16[1,2,256,128]) custom-call(...), custom_call_target=...",
        13: "%copy-start.2 = (f32[1024]) copy-start(f32[1024] %p1)",
    }
    stats = ["hlo_op", "program_id", "hlo_module", "name", "Hlo Proto"]
    core = _plane(1, "/device:TPU:0", stats, [
        _line("Steps", [_event(10, 0, 1000, {})]),
        _line("XLA Modules", [_event(10, 100, 800, {})]),
        _line("XLA Ops", [_event(11, 100, 300, {}), _event(12, 400, 200, {})]),
        _line("Async XLA Ops", [_event(13, 100, 700, {0: "copy-done.2"})]),
    ], event_names=names)  # fmt: skip
    metadata = _plane(3, "/host:metadata", stats, [], hlo_protos={"jit_train_step(7)": (7, hlo)})
    path = tmp_path / "tpu.xplane.pb"
    path.write_bytes(_message((1, core), (1, metadata)))

    events = step_profile.read_op_events(path)
    assert [(e.hlo_op, e.category, e.named) for e in events] == [
        ("convolution.1", MATMULS, True), ("custom-call.3", ATTENTION_BACKWARD, True),
    ]  # fmt: skip
    split = step_profile.step_split(events, steps=1, wall_ns=1000)
    assert split[MATMULS] == pytest.approx(300 / 1e6)
    assert split[HOST_IDLE] == pytest.approx(500 / 1e6)


# A protobuf encoder for the hand-built XSpace (tsl's xplane.proto, xla's hlo.proto).


def _varint(value):
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _message(*fields):
    out = b""
    for number, value in fields:
        if isinstance(value, int):
            out += _varint(number << 3) + _varint(value)
        else:
            data = value.encode() if isinstance(value, str) else value
            out += _varint(number << 3 | 2) + _varint(len(data)) + data
    return out


def _packed(*values):
    return b"".join(_varint(value) for value in values)


def _stat(metadata_id, value):
    if isinstance(value, int):
        return _message((1, metadata_id + 1), (4, value))  # int64_value
    if isinstance(value, bytes):
        return _message((1, metadata_id + 1), (6, value))  # bytes_value
    return _message((1, metadata_id + 1), (5, value))  # str_value


def _event(metadata_id, start_ns, duration_ns, stats):
    return _message(
        (1, metadata_id), (2, start_ns * 1000), (3, duration_ns * 1000),
        *[(4, _stat(key, value)) for key, value in stats.items()],
    )  # fmt: skip


def _line(name, events):
    return _message((1, 1), (2, name), (3, 0), *[(4, event) for event in events])


def _plane(plane_id, name, stat_names, lines, hlo_protos=None, event_names=None):
    """event_names: {metadata id: event name}; id 1 is "kernel", hlo_protos' ids count from 2."""
    fields = [(1, plane_id), (2, name), *[(3, line) for line in lines]]
    for metadata_id, event_name in {1: "kernel", **(event_names or {})}.items():
        metadata = _message((1, metadata_id), (2, event_name))
        fields.append((4, _message((1, metadata_id), (2, metadata))))
    for index, (module, (program_id, proto)) in enumerate((hlo_protos or {}).items(), start=2):
        stats = [(5, _stat(1, program_id)), (5, _stat(4, proto))]
        fields.append((4, _message((1, index), (2, _message((1, index), (2, module), *stats)))))
    for index, stat_name in enumerate(stat_names, start=1):
        fields.append((5, _message((1, index), (2, _message((1, index), (2, stat_name))))))
    return _message(*fields)
