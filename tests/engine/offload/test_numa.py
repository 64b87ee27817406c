"""NUMA placement of host experts (engine.offload.numa) on a faked two-node sysfs tree: parsing,
byte-balanced placement, first-touch copies and per-node computation giving the single-stack output."""

from __future__ import annotations

import argparse
import os
import random

import pytest
import torch

import kimitui.engine.engine as engine_module
from kimitui.commands.info import numa_lines
from kimitui.engine import LLM, SamplingParams
from kimitui.engine.offload import cpu_experts, numa
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.quantized import quantize_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)


def fake_sysfs(root, nodes: dict[int, str], mem_kb: int = 1 << 20, extra: dict[int, str] | None = None):
    for n, cpulist in {**nodes, **(extra or {})}.items():
        d = root / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        (d / "meminfo").write_text(f"Node {n} MemTotal:       {mem_kb * (n + 1)} kB\nNode {n} MemFree:  1 kB\n")
    (root / "possible").write_text("0-1\n")  # other sysfs entries are ignored
    return root


def test_fake_two_node_sysfs_is_parsed(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-3,8", 1: "4-7,9-10"}, extra={2: ""})  # node 2: memory only
    topo = numa.read_topology(root)
    assert [n.node for n in topo.nodes] == [0, 1] and topo.multi
    assert topo.nodes[0].cpus == (0, 1, 2, 3, 8) and topo.nodes[1].cpus == (4, 5, 6, 7, 9, 10)
    assert topo.nodes[0].mem_bytes == (1 << 30) and topo.nodes[1].mem_bytes == 2 << 30
    assert topo.summary_lines()[1] == "node 1    cpus 4-7,9-10 (6), 2.0 GiB"
    lines = numa_lines(argparse.Namespace(), str(root))
    assert lines[-1].startswith("policy    --numa auto: host experts split over 2 nodes")
    assert "one host-expert stack" in numa_lines(argparse.Namespace(numa="off"), str(root))[-1]


def test_bad_sysfs_and_policy_are_named(tmp_path):
    fake_sysfs(tmp_path, {0: "0-x"})
    with pytest.raises(ValueError, match=r"node0/cpulist: cannot parse CPU range '0-x'"):
        numa.read_topology(tmp_path)
    with pytest.raises(ValueError, match="numa policy must be one of auto, off, got 'interleave'"):
        numa.NumaPolicy("interleave")
    empty = numa.read_topology(tmp_path / "missing")  # no sysfs: one node with this process's CPUs
    assert len(empty.nodes) == 1 and set(empty.nodes[0].cpus) == os.sched_getaffinity(0)
    assert not numa.NumaPolicy("auto").split(empty)


def test_placement_is_balanced_by_bytes_and_deterministic():
    assert numa.assign_experts([10] * 8, 2) == [(0, 4), (4, 8)]
    assert numa.assign_experts([10] * 7, 2) == [(0, 4), (4, 7)]  # a tie goes to the earlier node
    assert numa.assign_experts([40, 10, 10, 10, 10], 2) == [(0, 1), (1, 5)]  # 40 | 40 bytes
    assert numa.assign_experts([5], 2) == [(0, 1), (1, 1)]  # fewer experts than nodes
    rng = random.Random(0)
    sizes = [rng.randrange(1, 100) for _ in range(384)]
    ranges = numa.assign_experts(sizes, 4)
    assert ranges == numa.assign_experts(sizes, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 384 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    shares = [sum(sizes[a:b]) for a, b in ranges]
    assert max(shares) - min(shares) <= 2 * max(sizes)
    with pytest.raises(ValueError, match="num_nodes must be >= 1"):
        numa.assign_experts([1], 0)


def test_pinned_threads_and_first_touch(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    pins = [(c,) for c in cpus[:2]]
    before = os.sched_getaffinity(0)
    seen = numa.run_pinned(pins, [lambda: os.sched_getaffinity(0)] * len(pins))
    assert seen == [set(p) for p in pins]
    assert cpu_experts.NodeWorkers().pool(pins[-1]).submit(os.sched_getaffinity, 0).result() == set(pins[-1])
    assert os.sched_getaffinity(0) == before  # the caller's own mask is untouched
    t = torch.arange(12.0).reshape(3, 4)[:, 1:]
    c = numa.first_touch_copy(t)
    assert torch.equal(c, t) and c.is_contiguous() and c.data_ptr() != t.data_ptr()


def _run(path, monkeypatch, topo, policy, prompts, offload):
    monkeypatch.setattr(engine_module, "read_topology", lambda: topo)
    touched = []
    real = numa.first_touch_copy
    monkeypatch.setattr(numa, "first_touch_copy", lambda t: touched.append(os.sched_getaffinity(0)) or real(t))
    with LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=2, cpu_offload=offload, numa=policy) as llm:
        experts = llm.engine.model.model.layers[1].mlp.experts
        out = llm.generate(prompts, PARAMS)
        return out, experts, llm.engine.numa_layers, touched


@pytest.mark.parametrize("method", ["dense", "int4"])
def test_two_node_path_gives_the_single_node_output(tmp_path, monkeypatch, method):
    if method == "int4" and not cpu_quant_moe.available():
        pytest.skip("the C++ extension does not build here")
    hf = write_hf_checkpoint(tmp_path, seed=5, num_hidden_layers=2)
    if method != "dense":
        quantize_checkpoint(tmp_path, method, hf)
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    two = numa.read_topology(fake_sysfs(tmp_path / "sys", {0: cpus, 1: cpus}))  # both "nodes" on this machine's CPUs
    rng = random.Random(3)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (5, 30)]
    n_host = 6

    plain, experts, layers, touched = _run(tmp_path, monkeypatch, two, "off", prompts, n_host)
    assert layers == 0 and not experts.executor.nodes and not touched  # off: one stack, as before
    host_tensors = [*experts.host.parameters(), *experts.host.buffers()]  # INT4: the tiles are buffers
    assert experts.host.num == n_host and sum(t.numel() for t in host_tensors) > 0

    split, experts, layers, touched = _run(tmp_path, monkeypatch, two, "auto", prompts, n_host)
    assert layers >= 1 and len(experts.executor.nodes) == 2
    assert [sub.num for _, sub, _ in experts.executor.nodes] == [3, 3]  # equal-sized experts: halves
    assert all(t == set(sorted(os.sched_getaffinity(0))) for t in touched) and touched
    maps = [m for _, _, m in experts.executor.nodes]
    assert ((maps[0] >= 0) ^ (maps[1] >= 0)).sum() == n_host  # every host expert on exactly one node
    host_tensors = [*experts.host.parameters(), *experts.host.buffers()]
    assert all(t.numel() == 0 for t in host_tensors)  # the single stack gave its memory up
    for a, b in zip(plain, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for i in range(1, len(a.prompt_logprobs)):
            for tok, lp in a.prompt_logprobs[i].items():
                assert abs(b.prompt_logprobs[i][tok] - lp) < 1e-4
