import importlib.util, sys, torch, json, os
spec = importlib.util.spec_from_file_location("dist_run", "bench/distributed/run.py")
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
args = m.parse(["--preset", "paper", "--mods", "paper", "--arms", "bf16"])
device = m._init("cuda")
import loka.distributed as ld
from loka.data import SyntheticCTR
model, _ = m._build(args, device, "bf16")
data = SyntheticCTR(model.feature_spec, 4096, seed=0, device=device)
batches = [ld.shard_batch(next(data)) for _ in range(2)]
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(4):
    m._train_step(model, opt, "bf16", batches[i % 2])
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(2):
        m._train_step(model, opt, "bf16", batches[i % 2])
    torch.cuda.synchronize()
out = os.environ["OUT"]
with open(f"{out}/prof_cuda.txt", "w") as f:
    f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
with open(f"{out}/prof_cpu.txt", "w") as f:
    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
n = sum(p.numel() for p in model.parameters())
print("params", n, "tables", len(getattr(model, "feature_spec").tables))
torch.distributed.destroy_process_group()
