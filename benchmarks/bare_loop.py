"""The physical baseline: ``python -m benchmarks.bare_loop CONFIG.json OUT.json``.

A plain PyTorch training loop doing exactly the work a harness trial times (the same model
code, data, batch, dtype, optimizer settings and number of steps), with none of the harness
around it: no strategies, no precision wrapper, no process group, no loss bookkeeping. The
timed steps are timed by the harness's own ``StepTimer`` (back to back, the device synchronised
only around them; CUDA events or the host clock between steps, medians), and the wall clock of
the whole block is reported beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.meters.timing import StepTimer
from harness.trial.config import TrialConfig
from harness.workloads import build_workload, load_dataset
from harness.workloads.tensors import INPUTS, TARGETS, batches


def main(config_path: str, out_path: str) -> None:
    config = TrialConfig.from_json(Path(config_path).read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.seed)
    data = load_dataset(config.dataset, config.dataset_options, config.seed)
    workload = build_workload(config.model_family, config.knobs, data.info)
    model = workload.model.to(device).train()
    optimizer = torch.optim.Adam(
        model.parameters(),
        lr=config.optimizer.lr,
        foreach=config.optimizer.foreach,
        fused=False,
    )
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.dtype)
    size = config.batch_size
    warmup = config.warmup_steps + config.memory_steps
    steps = warmup + config.timed_steps
    # The very batches a harness trial trains on, each its own tensor, all staged on the device
    # before the loop starts, as the harness stages its timed window.
    stream = batches(data.train, size, config.seed)
    staged = [
        tuple(batch[name].to(device) for name in (INPUTS, TARGETS))
        for batch in (next(stream) for _ in range(steps))
    ]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, -2).float(), y.flatten()).backward()
        optimizer.step()

    for x, y in staged[:warmup]:  # the harness's warm-up and memory-window steps, untimed
        step(x, y)
    timer = StepTimer(device)
    timer.run(lambda batch: step(*batch), staged[warmup:])
    samples = size * data.info.tokens_per_sample
    Path(out_path).write_text(
        json.dumps(
            {
                **timer.metrics(samples),
                "throughput_wall": samples * len(timer.step_ms) / (sum(timer.step_ms) / 1000),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
