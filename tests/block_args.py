"""The catalogue of tests/test_block_args.py: every public block, a call with good arguments, and the kind of each
argument, from which the bad values come. Imports no project module: the same file runs against the import and,
copied beside it, against a block's pasted closure (the names come from the namespace given)."""
import math
import re
import traceback

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

# Kinds: ("int", low, high), ("float", bounds), ("array", bounds, ndim, integral), ("choice", names), ("bool",),
# ("callable",), ("generator",), ("model",), ("input",) one (C, H, W), ("batch",) a (B, C, H, W), ("labels",) (B,)
# integers (B fixed by x), ("counts",) integers, ("tensor",) any floating-point tensor, ("list",) a non-empty
# list of its own kind, ("dict",), ("object",) an object of its own type. A kind ending in "?" may be None; an
# array kind's fifth entry holds "bools" where bools are 0/1 and "inf" where infinities are numbers too.
POS = {"gt": 0}
PROB = {"gt": 0, "lt": 1}
UNIT = {"ge": 0, "le": 1}


def within(value, bounds, flags=()):
    """value is a good number for bounds (ge, gt, le, lt): finite (flags "inf": not NaN) and within them; flags
    "-inf": -inf is good too (a row that never counts)."""
    if "-inf" in flags and value == -math.inf:
        return True
    inf = "inf" in flags
    ops = {"ge": value >= bounds.get("ge", -math.inf), "gt": value > bounds.get("gt", -math.inf),
           "le": value <= bounds.get("le", math.inf), "lt": value < bounds.get("lt", math.inf)}
    return (math.isfinite(value) or inf and not math.isnan(value)) and all(ops[k] for k in bounds)


def setup():
    """The shared objects of the good calls: a tiny model (1, 8, 8) -> 10 classes, images and labels."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(256, 10))
    images = torch.rand(12, 1, 8, 8)
    labels = torch.arange(12) % 10
    return net, images, labels


def catalogue(ns):
    """[(block, make the good arguments (a fresh dict each call), {argument: kind})] with the blocks of namespace ns
    (the names a block needs that are not there are skipped: each pasted file holds one module's blocks)."""
    net, images, labels = setup()
    x, xb, yb = images[0], images[:4], labels[:4]
    g = lambda: torch.Generator().manual_seed(0)
    on_grid = torch.randint(0, 17, (1, 8, 8)) / 16.0
    model, batch, ys = ("model",), ("batch",), ("labels",)
    N, alpha, sigma = ("int", 1, None), ("float", {"gt": 0, "lt": 0.5}), ("float", POS)
    T, eps, lbd = ("int", 0, None), ("float", {"ge": 0}), ("float", {"ge": 0})
    c = {}
    c["clopper_pearson_lower"] = c["clopper_pearson_upper"] = (
        lambda: dict(nA=5, N=10, alpha=0.01),
        {"nA": ("array", {"ge": 0}, None, False), "N": ("array", {"ge": 1}, None, True),
         "alpha": ("array", {"ge": 0, "lt": 1}, None, False)})
    c["certified_radius"] = (lambda: dict(pA_lower=0.9, sigma=0.5),
                             {"pA_lower": ("array", UNIT, None, False), "sigma": sigma})
    c["example_generator"] = (lambda: dict(seed=0, idx=1), {"seed": ("int", 0, None), "idx": ("int", 0, None)})
    c["gaussian_copies"] = (lambda: dict(x=xb, k=3, sigma=0.5, generator=g()),
                            {"x": batch, "k": N, "sigma": sigma, "generator": ("generator?",)})
    c["pass_sizes"] = (lambda: dict(n=10, per_pass=3), {"n": ("int", 0, None), "per_pass": N})
    c["sample_counts"] = (lambda: dict(model=net, x=xb[:2], sigma=0.5, n=20, batch=10, num_classes=10, generator=g()),
                          {"model": model, "x": batch, "sigma": sigma, "n": N, "batch": N, "num_classes": N,
                           "generator": ("generator?",), "copies": ("callable",), "stop": ("callable?",)})
    c["grid_levels"] = (lambda: dict(x=on_grid, levels=16), {"x": ("tensor",), "levels": N})
    c["sound_noisy_inputs"] = (lambda: dict(a=(on_grid * 16).round().int().unsqueeze(0), k=2, sigma=0.5, levels=16),
                               {"a": ("ints",), "k": N, "sigma": sigma, "generator": ("generator?",), "Q": N,
                                "levels": N})
    c["sound_copies"] = (lambda: dict(levels=16), {"levels": N})
    c["sphere_pgd"] = (lambda: dict(model=net, x=xb, y=yb, delta=0.5 * torch.randn(2, 4, 1, 8, 8), T=1, eps=0.25),
                       {"model": model, "x": batch, "y": ys, "T": T, "eps": eps, "delta": ("tensor",),
                        "norm_type": ("choice", ("l2", "linf"))})
    c["gaussian_loss"] = (lambda: dict(model=net, x=xb, y=yb, sigma=0.5, m=2),
                          {"model": model, "x": batch, "y": ys, "sigma": sigma, "m": N})
    c["split_chunks"] = (lambda: dict(batch=(xb, yb, torch.arange(4)), m=2), {"m": N})
    c["count_correct"] = (lambda: dict(model=net, dataset=torch.utils.data.TensorDataset(images, labels),
                                       indices=[0, 3], sigma=0.5, n=10, batch=20),
                          {"model": model, "indices": ("array", {"ge": 0, "lt": 12}, 1, True), "sigma": sigma,
                           "n": N, "batch": N, "workers": ("int", 0, None)})
    c["per_example_grad_norms"] = (
        lambda: dict(model=net, loss_fn=lambda f, x, y, idx: {"loss": f(x).sum()}, x=xb[:2], y=yb[:2]),
        {"model": model, "loss_fn": ("callable",), "x": batch, "y": ys})
    c["make_optimizer"] = (lambda: dict(model=net), {"model": model, "lr": sigma, "momentum": ("float", {"ge": 0}),
                                                     "weight_decay": ("float", {"ge": 0})})
    c["make_scheduler"] = (lambda: dict(optimizer=torch.optim.SGD(net.parameters(), lr=0.1), lr_step=10),
                           {"optimizer": ("object",), "lr_step": N, "gamma": ("float", {"gt": 0, "le": 1}),
                            "milestones": ("array?", {"ge": 1}, 1, True, "empty")})
    c["random_crop_flip"] = (lambda: dict(x=x), {"x": ("input",), "padding": ("int", 0, None)})
    c["autocast"] = (lambda: dict(device_type="cpu"), {"precision": ("choice", ("fp32", "bf16", "fp16"))})
    c["in_precision"] = (lambda: dict(model=net, precision="fp32"),
                         {"model": model, "precision": ("choice", ("fp32", "bf16", "fp16"))})
    step = lambda f, x, y, idx: {"loss": f(x).logsumexp(1).mean(), "correct": torch.zeros(()), "total": len(x)}
    c["train_epoch"] = (lambda: dict(model=net, loader=[(xb, yb, torch.arange(4))],
                                     optimizer=torch.optim.SGD(net.parameters(), lr=0.0), loss_fn=step, chunks=2,
                                     device=torch.device("cpu")),
                        {"model": model, "optimizer": ("object",), "loss_fn": ("callable",), "chunks": N,
                         "device": ("object",), "progress": ("callable?",), "max_batches": ("int?", 1, None),
                         "precision": ("choice", ("fp32", "bf16", "fp16")), "graph": ("bool",)})
    c["evaluate_noisy"] = (lambda: dict(model=net, loader=[(xb, yb)], sigma=0.5, device=torch.device("cpu")),
                           {"model": model, "sigma": ("float", {"ge": 0}), "device": ("object",),
                            "generator": ("generator?",)})
    # certify.py, grid.py
    c["certify"] = (lambda: dict(model=net, x=x, sigma=0.5, N0=10, N=20, alpha=0.01, batch=20, num_classes=10,
                                 generator=g()),
                    {"model": model, "x": ("input",), "sigma": sigma, "N0": N, "N": N, "alpha": alpha, "batch": N,
                     "num_classes": N, "generator": ("generator?",), "sample": ("callable",),
                     "candidate": ("int?", 0, 9)})
    c["predict"] = (lambda: dict(model=net, x=x, sigma=0.5, N=20, alpha=0.01, batch=20, num_classes=10, generator=g()),
                    {"model": model, "x": ("input",), "sigma": sigma, "N": N, "alpha": alpha, "batch": N,
                     "num_classes": N, "generator": ("generator?",), "sample": ("callable",)})
    plan_args = dict(radii=[0.25, 0.5], sigma=0.5, N_max=200, alpha=0.01)
    c["grid_plan"] = (lambda: dict(plan_args),
                      {"radii": ("array", {"ge": 0}, 1, False), "sigma": sigma, "N_max": N, "alpha": alpha,
                       "beta": ("float?", {"ge": 0, "lt": 1}), "final_look": ("bool",), "zero_level": ("bool",),
                       "looks": ("array?", {"ge": 1, "le": 200}, 1, True)})
    plan = ns["grid_plan"](**plan_args) if "grid_plan" in ns else None
    grid_kinds = {"model": model, "sigma": sigma, "N0": ("int", 0, None), "batch": N, "num_classes": N,
                  "plan": ("dict",), "copies": ("callable",)}
    c["grid_certify"] = (lambda: dict(model=net, x=x, sigma=0.5, N0=10, batch=20, num_classes=10, generator=g(),
                                      plan=plan),
                         dict(grid_kinds, x=("input",), generator=("generator?",), candidate=("int?", 0, 9)))
    c["grid_certify_many"] = (lambda: dict(model=net, items=[(x, g(), None)], sigma=0.5, N0=10, batch=20,
                                           num_classes=10, plan=plan), dict(grid_kinds, items=("list",)))
    c["look_schedule"] = (lambda: dict(N_max=1000), {"N_max": N, "first": N, "growth": ("float", {"gt": 1}),
                                                     "max_gap": N})
    c["kt_interval"] = (lambda: dict(A=0, t=10, alpha_low=0.01, beta_up=0.2),
                        {"A": ("int", 0, 10), "t": ("int", 0, None), "alpha_low": ("float", {"ge": 0, "lt": 1}),
                         "beta_up": ("float", {"ge": 0, "lt": 1}), "prior": ("array", POS, 1, False)})
    # train_ours.py, train_baselines.py
    c["ours_loss"] = (lambda: dict(model=net, x=xb, y=yb, sigma=0.5, m=2, T=1, eps=0.25, attack="l2"),
                      {"model": model, "x": batch, "y": ys, "sigma": sigma, "m": N, "T": T, "eps": eps,
                       "attack": ("choice", ("l2", "linf"))})
    c["discard_hard"] = (lambda: dict(model=net, dataset=torch.utils.data.TensorDataset(images, labels), sigma=0.5,
                                      N=10, pt=0.5, batch=40),
                         {"model": model, "sigma": sigma, "N": N, "pt": ("float", UNIT), "batch": N})
    c["keep_easy"] = (lambda: dict(counts=torch.tensor([3, 9]), N=10, pt=0.5),
                      {"N": N, "pt": ("float", UNIT), "counts": ("counts",)})
    c["radius_weights"] = (lambda: dict(counts=[3, 16], N=16, alpha=0.1, p_min=0.75, formula="code"),
                           {"counts": ("array", {"ge": 0, "le": 16}, 1, True), "N": N, "alpha": alpha,
                            "p_min": ("float", {"gt": 0.5, "lt": 1}), "formula": ("choice", ("paper", "code"))})
    c["code_weight_floor"] = (lambda: dict(N=16, alpha=0.1, p_min=0.75),
                              {"N": N, "alpha": alpha, "p_min": ("float", PROB)})
    loss = {"model": model, "x": batch, "y": ys, "sigma": sigma, "m": N}
    c["smoothadv_loss"] = (lambda: dict(model=net, x=xb, y=yb, idx=None, sigma=0.5, m=2, T=1, eps=0.25),
                           dict(loss, T=T, eps=eps, warm=("float", UNIT), attack=("callable",)))
    c["macer_loss"] = (lambda: dict(model=net, x=xb, y=yb, idx=None, sigma=0.5, m=2, beta=16.0, gamma=8.0, lbd=12.0),
                       dict(loss, beta=sigma, gamma=sigma, lbd=lbd))
    c["consistency_loss"] = (lambda: dict(model=net, x=xb, y=yb, idx=None, sigma=0.5, m=2, lbd=10.0, eta=0.5),
                             dict(loss, lbd=lbd, eta=lbd))
    c["smoothmix_loss"] = (lambda: dict(model=net, x=xb, y=yb, idx=None, sigma=0.5, m=2, T=2, alpha=0.5, eta=1.0,
                                        mix_step=1, warm=1.0),
                           dict(loss, T=T, alpha=eps, eta=lbd, mix_step=("int", 0, None), warm=("float", UNIT),
                                maxnorm=("float?", POS)))
    c["catrs_loss"] = (lambda: dict(model=net, x=xb, y=yb, idx=torch.arange(4), sigma=0.5, m=2, T=1, eps=0.25,
                                    lbd=0.5, target=torch.full((12, 10), 0.1)),
                       dict(loss, T=T, eps=eps, lbd=lbd, target=("tensor",), idx=("labels",),
                            confidence_mask=("bool",)))
    noise = lambda: 0.25 * torch.randn(2, 4, 1, 8, 8)
    attack = {"model": model, "x": batch, "y": ys, "noise": ("tensor",), "T": T, "eps": eps}
    c["smoothadv_attack"] = (lambda: dict(model=net, x=xb, y=yb, noise=noise(), T=1, eps=0.25), attack)
    c["ddn_attack"] = (lambda: dict(model=net, x=xb, y=yb, noise=noise(), T=1, eps=0.25),
                       dict(attack, gamma=("float", PROB), levels=("int", 2, None)))
    c["smoothmix_attack"] = (lambda: dict(model=net, x=xb, y=yb, noise=noise(), T=2, alpha=0.5, mix_step=1, warm=1.0),
                             dict(attack, eps=None, alpha=eps, mix_step=("int", 0, None), warm=("float", UNIT),
                                  maxnorm=("float?", POS)))
    del c["smoothmix_attack"][1]["eps"]
    c["catrs_attack"] = (lambda: dict(model=net, x=xb, pb=torch.full((4, 10), 0.1), delta=noise(), T=1, eps=0.25),
                         {"model": model, "x": batch, "pb": ("tensor",), "delta": ("tensor",), "T": T, "eps": eps})
    c["bottom_k_sum"] = (lambda: dict(values=torch.rand(3, 4), K=torch.tensor([1, 2, 3, 3])),
                         {"values": ("tensor",), "K": ("counts",)})
    c["project_l2"] = (lambda: dict(v=xb, radius=0.5), {"radius": eps})
    c["stability_loss"] = (lambda: dict(model=net, x=xb, y=yb, idx=None, sigma=0.5, lbd=1.0),
                           {"model": model, "x": batch, "y": ys, "sigma": sigma, "lbd": lbd})
    # ddrs.py
    c["sigma_generator"] = (lambda: dict(seed=0, idx=1, device="cpu"),
                            {"seed": ("int", 0, None), "idx": ("int", 0, None), "stream": ("int", 0, None)})
    c["radius_proxy"] = (lambda: dict(model=net, x=xb, s=torch.full((4,), 0.5), e=torch.randn(2, 4, 1, 8, 8)),
                         {"model": model, "x": batch, "s": ("tensor",), "e": ("tensor",), "cA": ("labels?",),
                          "clamp": ("array", PROB, 1, False)})
    c["smoothed_class"] = (lambda: dict(model=net, x=x, sigma0=0.5, num_classes=10, generator=g(), batch=20, draws=10,
                                        max_draws=20),
                           {"model": model, "x": ("input",), "sigma0": sigma, "num_classes": ("int", 2, None),
                            "generator": ("generator?",), "batch": N, "precision": ("choice", ("fp32", "bf16", "fp16")),
                            "draws": N, "max_draws": N, "alpha": alpha})
    c["optimize_sigma"] = (lambda: dict(model=net, x=xb[:2], sigma0=0.5, K=1, M=2, lr=1e-3,
                                        generators=[g(), torch.Generator().manual_seed(1)]),
                           {"model": model, "x": batch, "sigma0": sigma, "K": T, "M": N, "lr": ("float", {"ge": 0}),
                            "generators": ("list",), "clamp": ("array", PROB, 1, False), "fixed_cA": ("bool",),
                            "keep_best": ("bool",), "cA": ("array?", {"ge": 0}, 1, True), "bounds": ("list",)})
    c["knn_distance"] = (lambda: dict(train=torch.rand(20, 64), x=x, k=3, chunk=8),
                         {"train": ("tensor",), "x": ("tensor",), "k": ("int", 1, 20), "chunk": N})
    c["worst_class_b"] = (lambda: dict(d=0.1, sigma0=0.5, sigma1=0.6, pA_lower=0.9, dim=64),
                          {"d": ("array", POS, None, False), "sigma0": sigma, "sigma1": ("array", POS, None, False),
                           "pA_lower": ("array", UNIT, None, False), "dim": N})
    c["semi_elastic_radius"] = (lambda: dict(pA_lower=0.9, sigma=0.5, r=0.01, dim=64, scan=4, bisect=4, verify=2),
                                {"pA_lower": ("float", UNIT), "sigma": sigma, "r": ("float", {"ge": 0}), "dim": N,
                                 "scan": N, "bisect": N, "verify": N})
    c["memory_step"] = (lambda: dict(memory=[], x=x, c=1, r=0.5),
                        {"memory": ("object",), "x": ("tensor",), "c": ("int", -1, None), "r": ("float", {"ge": 0}),
                         "rule": ("choice", ("paper", "code"))})
    # analyze.py's metrics
    radius_arg = ("array", {"ge": 0}, 1, False)
    correct_arg = ("array", UNIT, 1, True, "bools")
    budget = {"N": N, "alpha": alpha, "sigma": sigma}
    c["acr"] = (lambda: dict(radius=[0.5, 0.0, 1.0], correct=[1, 0, 1]), {"radius": radius_arg, "correct": correct_arg})
    c["certified_accuracy"] = (lambda: dict(radius=[0.5, 0.0, 1.0], correct=[1, 0, 1], radii=[0.0, 0.5]),
                               {"radius": radius_arg, "correct": correct_arg, "radii": ("array", {}, 1, False)})
    c["ecdf"] = (lambda: dict(pA=[0.5, 0.9, 1.0], ps=[0.5, 0.9]), {"pA": ("array", UNIT, 1, False, "-inf"),
                                                                   "ps": ("array", UNIT, None, False)})
    c["radius_of_count"] = (lambda: dict(nA=900, N=1000, alpha=0.001, sigma=0.5),
                            {"nA": ("array", {"ge": 0}, None, False), "N": ("array", {"ge": 1}, None, True),
                             "alpha": ("array", {"ge": 0, "lt": 1}, None, False), "sigma": sigma})
    for name in ("min_count", "min_pA", "pA_from_radius"):
        c[name] = (lambda: dict(radius=[0.1, 0.5], N=1000, alpha=0.001, sigma=0.5),
                   dict(budget, radius=("array", {}, None, False, "inf")))
    c["dkw_halfwidth"] = (lambda: dict(n=100), {"n": N, "level": alpha})
    c["ecdf_lookup"] = (lambda: dict(grid_p=[0.1, 0.5], grid_y=[1.0, 0.5], ps=[0.3]),
                        {"grid_p": ("array", {}, 1, False), "grid_y": ("array", {}, 1, False),
                         "ps": ("array", {}, None, False)})
    c["budget_accuracy"] = (lambda: dict(ecdf_at=lambda p: 0.5 + 0 * p, radii=[0.1], N=100, alpha=0.001, sigma=0.5),
                            dict(budget, ecdf_at=("callable",)))
    c["dominance"] = (lambda: dict(curves={"a": [0.5, 0.2], "b": [0.4, 0.1]}), {"curves": ("dict",)})
    for name in ("max_radius", "trivial_acr"):
        c[name] = (lambda: dict(N=100, alpha=0.001, sigma=0.5), dict(budget))
    for name in ("constant_pA_acr", "expected_constant_pA_acr"):
        c[name] = (lambda: dict(pA=0.9, N=100, alpha=0.001, sigma=0.5), dict(budget, pA=("float", UNIT)))
    c["order_flips"] = (lambda: dict(Ns=[10, 100], a=[1.0, 2.0], b=[2.0, 1.0]),
                        {"Ns": ("array", {}, 1, False), "a": ("array", {}, 1, False), "b": ("array", {}, 1, False)})
    c["radius_curve"] = (lambda: dict(ps=[0.6, 0.9], N=100, alpha=0.001, sigma=0.5),
                         dict(budget, ps=("array", UNIT, None, False)))
    return [(name, make, kinds) for name, (make, kinds) in c.items() if name in ns]


# ----------------------------------------------------------------------------------------------------------
# Bad values of each kind: a fixed catalogue (the same values on both sides) and hypothesis strategies
# ----------------------------------------------------------------------------------------------------------

def bad_tensors(dims, kind="float"):
    """Tensors a block taking `dims` dimensions of a floating (or integer) dtype must refuse: a wrong dtype (uint8
    images among them), no tensor, a dimension more or less, an empty one."""
    make = lambda *shape: torch.rand(*shape) if kind == "float" else torch.zeros(shape, dtype=torch.long)
    good = make(*[2] * dims)
    wrong = [good.to(torch.uint8) if kind == "float" else good.float(), good.to(torch.bool), good.numpy(),
             good.tolist(), make(*[2] * (dims + 1)), make(*[0] * dims)]
    return wrong + ([make(*[2] * (dims - 1))] if dims > 1 else [])


FIXED = {
    "int": lambda kind: [kind[1] - 1, float(kind[1]), float(kind[1]) + 0.5, str(kind[1]), True, [kind[1]],
                         math.nan] + ([-1] if kind[1] > -1 else []) + ([kind[2] + 1] if kind[2] is not None else []),
    "float": lambda kind: [v for v in (math.nan, math.inf, -math.inf, 0.0, -1.0, 1.0, 1.5, 1e300)
                           if not within(v, kind[1])] + ["0.5", True, [0.5], torch.tensor([0.5, 0.5, 0.5])],
    "array": lambda kind: [["a"], [[1.0], [1.0, 2.0]], [math.nan], "0.5"] + ([[]] if "empty" not in kind[4:] else []) +
                          ([[True]] if "bools" not in kind[4:] else []) +
                          ([[2.5]] if kind[3] else []) + [[v] for v in (-math.inf, -1.0, 0.0, 1.0, 1.5, 1e300)
                                                          if not within(v, kind[1], kind[4:])],
    "choice": lambda kind: [kind[1][0].upper(), kind[1][0] + " ", "", 3, ["l2"]],
    "bool": lambda kind: [1, "True", np.float64(1.0)],
    "callable": lambda kind: [3, "f"],
    "generator": lambda kind: [3, "seed", np.random.default_rng(0)],
    "model": lambda kind: [3, "net"],
    "input": lambda kind: bad_tensors(3),
    "batch": lambda kind: bad_tensors(4),
    "labels": lambda kind: bad_tensors(1, "int") + [torch.zeros(5, dtype=torch.long)],
    "counts": lambda kind: bad_tensors(1, "int"),
    "ints": lambda kind: bad_tensors(1, "int")[:4],
    "object": lambda kind: [3, "ab"],
    "tensor": lambda kind: [torch.zeros(2, 2, dtype=torch.uint8), np.zeros((2, 2)), [[0.5]], 0.5],
    "list": lambda kind: ["ab", 3, []],
    "dict": lambda kind: [[("a", [0.5])], 3],
}


def fixed_bad(kind):
    values = FIXED[kind[0].rstrip("?")](kind)
    return [v for v in values if v is not None] + ([] if kind[0].endswith("?") else [None])


def strategy(kind):
    """Hypothesis: bad values of a kind, beyond the fixed ones (any out-of-range number, any string, ...)."""
    base, fixed = kind[0].rstrip("?"), st.sampled_from(fixed_bad(kind))
    junk = st.one_of(st.text(max_size=4), st.booleans(), st.builds(object))
    if base == "int":
        low, high = kind[1], kind[2]
        out = st.integers(max_value=low - 1) | (st.integers(min_value=high + 1) if high is not None else st.nothing())
        return st.one_of(fixed, out, st.integers(low, low + 10 ** 6).map(float), st.floats(), junk)
    if base == "float":
        number = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10 ** 6, 10 ** 6)
        return st.one_of(fixed, number.filter(lambda v: not within(v, kind[1])), st.floats().map(str), junk)
    if base == "array":
        out = st.floats(allow_nan=True, allow_infinity=True).filter(
            lambda v: not within(v, kind[1], kind[4:]))
        return st.one_of(fixed, st.lists(out, min_size=1, max_size=3), st.lists(st.text(min_size=1), min_size=1))
    if base == "choice":
        return st.one_of(fixed, st.text(max_size=6).filter(lambda s: s not in kind[1]), st.integers())
    return st.one_of(fixed, junk.filter(lambda v: base != "bool" or not isinstance(v, bool)))


# ----------------------------------------------------------------------------------------------------------
# One refusal: a TypeError or ValueError that names the argument, raised by the project's own check (the
# module's file, or the pasted one), before the model runs
# ----------------------------------------------------------------------------------------------------------

class Counting(torch.nn.Module):
    """The model, counting its forward passes: a refusal comes before any."""

    def __init__(self, net):
        super().__init__()
        self.net, self.calls = net, 0

    def forward(self, x):
        self.calls += 1
        return self.net(x)


def refusal(ns, block, make, name, value, project_files):
    """None when calling block with `name` = value is refused as it must be, else what went wrong."""
    args = make()
    counting = Counting(args["model"]) if isinstance(args.get("model"), torch.nn.Module) else None
    if counting is not None:
        args["model"] = counting
    args[name] = value
    try:
        ns[block](**args)
    except (TypeError, ValueError) as e:
        where = traceback.extract_tb(e.__traceback__)[-1].filename
        if not any(where.endswith(f) for f in project_files):
            return f"raised from {where}: {type(e).__name__}: {e}"
        if not re.search(rf"(?<![\w.]){re.escape(name)}\b", str(e)):
            return f"the message does not name {name}: {type(e).__name__}: {e}"
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and ".float() / 255" not in str(e):
            return f"a uint8 input without the conversion to use: {e}"
        if counting is not None and counting.calls:
            return f"refused after {counting.calls} forward passes"
        return None
    except Exception as e:   # noqa: BLE001 -- what a check must never let through
        return f"{type(e).__name__} (not a TypeError or ValueError): {e}"
    return "accepted"


def outcome(ns, block, make, name, value):
    """What a call gives, to compare the import with the pasted closure: (error type, message) or 'ok'."""
    args = make()
    args[name] = value
    try:
        ns[block](**args)
        return "ok"
    except Exception as e:   # noqa: BLE001
        return [type(e).__name__, str(e)]


def check_property(ns, block, make, name, kind, project_files, examples):
    """The property over hypothesis's bad values of this kind; raises AssertionError with the first counterexample."""
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(value=strategy(kind))
    def prop(value):
        problem = refusal(ns, block, make, name, value, project_files)
        assert problem is None, f"{block}({name}={value!r:.60}): {problem}"
    prop()


def check_argument(ns, block, make, name, kind, project_files, examples):
    """(None or the first failure, {i: outcome of the i-th fixed value}): the fixed values, then the property."""
    problem, outcomes = None, {}
    for i, value in enumerate(fixed_bad(kind)):
        found = None if problem else refusal(ns, block, make, name, value, project_files)
        problem = problem or (found and f"{block}({name}={value!r:.60}): {found}")
        outcomes[i] = outcome(ns, block, make, name, value)
    if problem is None:
        try:
            check_property(ns, block, make, name, kind, project_files, examples)
        except AssertionError as e:
            problem = str(e).splitlines()[0]
    return problem, outcomes


def run_all(ns, project_files, examples, only=None):
    """{'block:argument': None or the failure} over the catalogue (only: these blocks), and
    {'block:argument:i': outcome} of the fixed values, to compare between import and paste."""
    torch.set_num_threads(1)
    failures, outcomes = {}, {}
    for block, make, kinds in catalogue(ns):
        for name, kind in kinds.items():
            if only is None or block in only:
                key = f"{block}:{name}"
                failures[key], theirs = check_argument(ns, block, make, name, kind, project_files, examples)
                outcomes.update({f"{key}:{i}": o for i, o in theirs.items()})
    return failures, outcomes
