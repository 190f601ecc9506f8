import warnings, time, cProfile, pstats, sys; warnings.filterwarnings("ignore")
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import hypergrid.mesh, torch._dynamo
W = 1 << 20
dist.init_process_group("fake", store=FakeStore(), rank=W//2+3, world_size=W)
from hypergrid import HyperCommGrid, device_mesh
pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
grid = HyperCommGrid([4, 2, W // 8], ["tp", "cp", "dp"])
mesh = device_mesh(grid, device_type="cpu", flatten={"dp_cp": ["cp", "dp"], "cp_tp": ["tp", "cp"]})
pr.disable(); print("ms", (time.perf_counter()-t)*1e3)
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
