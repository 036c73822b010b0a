"""Shared building blocks of randomized smoothing (RS): models, data, noise, statistics, the training loop.

Everything the paper's numbers rest on lives here exactly once: the architectures of Cohen et al. (2019),
the datasets, the Gaussian noise and the Monte Carlo class
counter that CERTIFY and the training-time pA estimates share, the one-sided Clopper-Pearson bound and the
certified radius (Thm. of Cohen et al.), the adaptive attack on the noise sphere (Alg. 1) and the shared
training loop. Every function takes arguments and returns values: no argparse, no output files, no process
groups, nothing runs on import; copy any function into a notebook. What the commands do around these
(the output guard, checkpoints, resume, torchrun) is machinery.py's.
"""
import argparse
import contextlib
import functools
import math
import os
import types

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.special import betaincinv, ndtri   # scipy.stats' beta.ppf and norm.ppf, bit for bit, without its import time


DATASETS = ("cifar10", "imagenet", "digits")
ARCHS = ("cifar_resnet20", "cifar_resnet110", "resnet50", "lenet", "digits_cnn")
DEFAULT_ARCH = {"cifar10": "cifar_resnet110", "imagenet": "resnet50", "digits": "digits_cnn"}
NUM_CLASSES = {"cifar10": 10, "imagenet": 1000, "digits": 10}
INPUT_SHAPE = {"cifar10": (3, 32, 32), "imagenet": (3, 224, 224), "digits": (1, 8, 8)}
# Default schedule per dataset (App. C.1: CIFAR-10 150 epochs, lr x0.1 every 50; ImageNet 90, every 30).
# digits is our CPU demo, not in the paper: a short schedule that trains the small CNN in seconds.
SCHEDULE = {"cifar10": {"epochs": 150, "lr_step": 50}, "imagenet": {"epochs": 90, "lr_step": 30},
            "digits": {"epochs": 20, "lr_step": 10}}
# Normalisation constants of the released checkpoints' code (Cohen et al. and successors).
MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "imagenet": (0.485, 0.456, 0.406), "digits": (0.3,)}
STD = {"cifar10": (0.2023, 0.1994, 0.2010), "imagenet": (0.229, 0.224, 0.225), "digits": (0.38,)}


# ----------------------------------------------------------------------------------------------------------
# Models: Sequential(NormalizeLayer, net), with the parameter names of Cohen et al.'s released checkpoints
# ----------------------------------------------------------------------------------------------------------

class NormalizeLayer(nn.Module):
    """(x - mean) / std per channel. Non-persistent buffers: state_dicts keep Cohen's keys (`1.conv1.weight`)."""

    def __init__(self, mean, std):
        super().__init__()
        check(len(check_array("mean", mean, ndim=1)) == len(check_array("std", std, ndim=1, gt=0)),
              "mean and std: one value per channel each")
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def forward(self, x):
        return (x - self.mean) / self.std


class BasicBlock(nn.Module):
    """Post-activation residual block of the CIFAR ResNets (He et al. 2016) as in Cohen et al.'s code."""

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        residual = x if self.downsample is None else self.downsample(x)
        return self.relu(out + residual)


class CifarResNet(nn.Module):
    """CIFAR ResNet of depth 6n+2 (20, 110): widths 16/32/64, 8x8 average pool, one linear layer."""

    def __init__(self, depth, num_classes=10):
        super().__init__()
        assert (depth - 2) % 6 == 0, "depth must be 6n+2"
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(*[BasicBlock(16, 16) for _ in range(n)])
        self.layer2 = nn.Sequential(BasicBlock(16, 32, 2), *[BasicBlock(32, 32) for _ in range(n - 1)])
        self.layer3 = nn.Sequential(BasicBlock(32, 64, 2), *[BasicBlock(64, 64) for _ in range(n - 1)])
        self.avgpool = nn.AvgPool2d(8)
        self.fc = nn.Linear(64, num_classes)
        for mod in self.modules():  # He initialisation, as in the original code
            if isinstance(mod, nn.Conv2d):
                fan_out = mod.kernel_size[0] * mod.kernel_size[1] * mod.out_channels
                mod.weight.data.normal_(0, (2.0 / fan_out) ** 0.5)
            elif isinstance(mod, nn.BatchNorm2d):
                mod.weight.data.fill_(1)
                mod.bias.data.zero_()

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class LeNet(nn.Module):
    """LeNet-5 style CNN for small grey-scale images (padding keeps it valid down to 8x8 inputs)."""

    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5, padding=2)
        self.pool = nn.AdaptiveAvgPool2d(5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc3(F.relu(self.fc2(x)))


class DigitsCNN(nn.Module):
    """Small CNN for scikit-learn's 8x8 digits: fast enough for the CPU demo and the tests (has BatchNorm)."""

    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # (B, 32, 4, 4)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


ARCH_DATASETS = {"cifar_resnet20": ("cifar10",), "cifar_resnet110": ("cifar10",), "resnet50": ("cifar10", "imagenet"),
                 "lenet": DATASETS, "digits_cnn": ("digits",)}   # the inputs each architecture's layers take


def get_architecture(arch, dataset):
    """The base classifier f: Sequential(NormalizeLayer(mean, std), net); inputs live in [0, 1] pixel space."""
    check(arch in ARCHS, f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    check(dataset in DATASETS, f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    check(dataset in ARCH_DATASETS[arch], f"architecture {arch} does not take {dataset}'s inputs "
                                          f"{INPUT_SHAPE[dataset]}; it takes {' and '.join(ARCH_DATASETS[arch])}")
    channels, k = INPUT_SHAPE[dataset][0], NUM_CLASSES[dataset]
    if arch == "cifar_resnet20":
        net = CifarResNet(20, k)
    elif arch == "cifar_resnet110":
        net = CifarResNet(110, k)
    elif arch == "resnet50":
        import torchvision  # imported here: only ImageNet needs it for models
        net = torchvision.models.resnet50(num_classes=k)
    elif arch == "lenet":
        net = LeNet(channels, k)
    else:
        net = DigitsCNN(channels, k)
    return nn.Sequential(NormalizeLayer(MEAN[dataset], STD[dataset]), net)


# ----------------------------------------------------------------------------------------------------------
# Data: inputs in [0, 1]; normalisation is the model's first layer
# ----------------------------------------------------------------------------------------------------------

class TensorImages(torch.utils.data.Dataset):
    """Images held in memory as a float tensor (N, C, H, W) in [0, 1], an optional tensor transform."""

    def __init__(self, images, labels, transform=None):
        check_tensor("images", images, "N C H W")
        check(len(labels) == len(images), f"{len(labels)} labels for {len(images)} images: one label per image")
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[i])


def random_crop_flip(x, padding=4):
    """CIFAR training augmentation on one (C, H, W) tensor: random crop with zero padding, random h-flip."""
    check_tensor("x", x, "C H W")
    check_int("padding", padding, 0)
    _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    i, j = torch.randint(0, 2 * padding + 1, (2,)).tolist()
    x = padded[:, i:i + h, j:j + w]
    return x.flip(2) if torch.rand(()) < 0.5 else x


@functools.lru_cache(maxsize=1)
def _digits_arrays():
    """(images (1797, 8, 8) in 0..16, labels) of scikit-learn's bundled digits: its digits.csv.gz, read as
    load_digits reads it (the same arrays) without importing scikit-learn (a second of start-up)."""
    import importlib.util
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else ""
    if not os.path.isfile(path):   # another layout of scikit-learn: its loader
        from sklearn.datasets import load_digits
        data = load_digits()
        return data.images, data.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def _digits(split):
    """scikit-learn's bundled 8x8 digits in [0, 1], a fixed seeded 80/20 train/test split (no network)."""
    images, labels = _digits_arrays()
    images = torch.tensor(images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
    labels = torch.tensor(labels, dtype=torch.long)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(labels))
    part = perm[:cut] if split == "train" else perm[cut:]
    return TensorImages(images[part], labels[part])


MAX_PIXELS = 2 ** 26   # an image folder's images are small (CIFAR-10: 32x32); a bigger one is not a dataset image


def _image_folder_in_memory(folder, num_classes=None, shape=None):
    """Decode a small-image folder tree (`<class>/<image>`, classes sorted by name) into memory once.

    Contract: at least one class folder, each holding at least one image; num_classes (when given) class
    folders exactly; every image readable and of the same size (shape (3, H, W) when given). Hidden files are
    skipped. A violation is a UserError naming the folder or the image."""
    from PIL import Image, UnidentifiedImageError
    try:
        classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))
                         and not d.startswith("."))
    except OSError as e:
        raise UserError(f"image folder {folder!r}: cannot list it ({e.strerror})") from None
    check(classes, f"image folder {folder!r} has no class folders (expected <class>/<image> inside)")
    check(num_classes is None or len(classes) == num_classes,
          f"image folder {folder!r} has {len(classes)} class folders, the dataset has {num_classes}")
    images, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(folder, name)) if not f.startswith("."))
        check(files, f"image folder {folder!r}: class folder {name!r} holds no images")
        for fname in files:
            path = os.path.join(folder, name, fname)
            check(os.path.isfile(path), f"{path}: not a regular file (a FIFO, socket or folder); remove it")
            try:
                with Image.open(path) as img:
                    check(img.width * img.height <= MAX_PIXELS, f"{path}: {img.width}x{img.height} pixels, more "
                                                                f"than any dataset here; remove it")
                    images.append(np.asarray(img.convert("RGB"), dtype=np.uint8))
            except UserError:
                raise
            except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
                raise UserError(f"{path}: not a readable image ({type(e).__name__}); remove it") from None
            want = images[0].shape if shape is None else (shape[1], shape[2], shape[0])
            check(images[-1].shape == want, f"{path}: image of size {images[-1].shape[1]}x{images[-1].shape[0]}, "
                                            f"expected {want[1]}x{want[0]}")
            labels.append(label)
    images = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div_(255)  # (N, 3, H, W)
    return images, torch.tensor(labels, dtype=torch.long)


def _cifar10(split, data_dir, train_transform):
    folder = os.path.join(data_dir, "train" if split == "train" else "test")
    transform = random_crop_flip if train_transform and split == "train" else None
    check(not os.path.exists(folder) or os.path.isdir(folder), f"{folder!r} is not a folder; --data-dir must hold "
                                                                 f"train/ and test/ image folders, or torchvision's files")
    if os.path.isdir(folder):  # image-folder layout, e.g. the JPEG copy on offline machines
        images, labels = _image_folder_in_memory(folder, NUM_CLASSES["cifar10"], INPUT_SHAPE["cifar10"])
        return TensorImages(images, labels, transform)
    import torchvision
    made = not os.path.lexists(data_dir)
    try:
        ds = torchvision.datasets.CIFAR10(data_dir, train=(split == "train"), download=True)
    except Exception as e:  # offline, unwritable, corrupt: one line saying where we looked
        if made:   # the folder the failed download created, with its partial archive: nothing is left behind
            import shutil
            shutil.rmtree(data_dir, ignore_errors=True)
        raise UserError(f"CIFAR-10 not found in {data_dir!r} and could not be downloaded ({type(e).__name__}); "
                        f"put torchvision's cifar-10-batches-py or train/ and test/ image folders there "
                        f"and pass --data-dir") from None
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).float().div_(255)
    return TensorImages(images, torch.tensor(ds.targets, dtype=torch.long), transform)


def _imagenet(split, data_dir, train_transform):
    import torchvision
    from torchvision import transforms
    folder = os.path.join(data_dir, "train" if split == "train" else "val")
    check(os.path.isdir(folder), f"ImageNet folder {folder!r} not found; pass --data-dir with train/ and val/ "
                                 f"image folders (ImageNet cannot be downloaded automatically)")
    if split == "train" and train_transform:
        tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor()])
    else:
        tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()])
    return torchvision.datasets.ImageFolder(folder, tf)


def default_data_dir():
    """--data-dir default: $RS_DATA_DIR, else ./data."""
    return os.environ.get("RS_DATA_DIR", "./data")


def get_dataset(name, split, data_dir=None, train_transform=True):
    """Dataset of (x, y) with x a float tensor in [0, 1]. split: 'train' or 'test'.

    train_transform=False gives the training images without augmentation (e.g. for a fixed probe set).
    """
    check(name in DATASETS, f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    check(split in ("train", "test"), f"unknown split {split!r}; use train or test")
    data_dir = data_dir or default_data_dir()
    if name == "digits":
        return _digits(split)
    if name == "cifar10":
        return _cifar10(split, data_dir, train_transform)
    return _imagenet(split, data_dir, train_transform)


class WithIndex(torch.utils.data.Dataset):
    """Wrap a dataset so that it yields (x, y, idx): training needs idx for weights and per-example targets."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        """key: an index, or (index, seed) from TrainLoader, whose random augmentation then draws from seed."""
        if not isinstance(key, tuple):
            return (*self.dataset[key], key)
        i, seed = key
        saved = torch.get_rng_state()             # the caller's global generator (the noise) stays untouched
        torch.default_generator.manual_seed(seed)  # the CPU generator only (torch.manual_seed costs 40x more)
        try:
            x, y = self.dataset[i]
        finally:
            torch.set_rng_state(saved)
        return x, y, i


# ----------------------------------------------------------------------------------------------------------
# Statistics of CERTIFY (Cohen et al. 2019)
# ----------------------------------------------------------------------------------------------------------

def clopper_pearson_lower(nA, N, alpha):
    """One-sided (1 - alpha) Clopper-Pearson lower bound, elementwise: Beta(nA, N - nA + 1)'s alpha-quantile, 0 at 0."""
    nA, N, alpha = check_counts(nA, N, alpha)
    with np.errstate(invalid="ignore"):
        bound = betaincinv(np.where(nA > 0, nA, 1), N - nA + 1, alpha)
    bound = np.where(nA > 0, bound, 0.0)
    return float(bound) if bound.ndim == 0 else bound


def clopper_pearson_upper(nA, N, alpha):
    """One-sided (1 - alpha) Clopper-Pearson upper bound: the (1 - alpha)-quantile of Beta(nA + 1, N - nA); 1 at nA == N."""
    nA, N, alpha = check_counts(nA, N, alpha)
    with np.errstate(invalid="ignore"):
        bound = betaincinv(nA + 1, np.where(nA < N, N - nA, 1), 1 - alpha)
    bound = np.where(nA < N, bound, 1.0)
    return float(bound) if bound.ndim == 0 else bound


def tango_interval(x12, x21, n, z):
    """Tango's (1998) score interval for p_B - p_A from n paired outcomes in [0, 1]: x12 the sum of B's excess
    over A (images where only B is 1, for 0/1 outcomes), x21 of A's over B. The deltas whose score statistic lies
    within +-z (z > 0: the normal quantile); the statistic falls in delta, so each end is found by bisection."""
    n = check_int("n", n)
    z = check_float("z", z, gt=0)
    x12, x21 = check_float("x12", x12, ge=0), check_float("x21", x21, ge=0)
    check(x12 + x21 <= n, f"x12 + x21 = {x12 + x21:g} exceeds n = {n}: at most one excess per pair")

    def score(delta):
        b = (2 * n - x12 + x21) * delta - x12 - x21
        c = -x21 * delta * (1 - delta)
        p21 = (-b + math.sqrt(max(b * b - 8 * n * c, 0.0))) / (4 * n)   # constrained MLE of P(only A is 1)
        num = x12 - x21 - n * delta
        return 0.0 if num == 0 else num / math.sqrt(max(n * (2 * p21 + delta * (1 - delta)), 1e-300))

    d = (x12 - x21) / n
    low, high = -1.0, 1.0
    if score(-1.0) > z:                     # the lower end: score(low) = z
        lo, hi = -1.0, d
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if score(mid) > z else (lo, mid)
        low = hi
    if score(1.0) < -z:                     # the upper end: score(high) = -z
        lo, hi = d, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if score(mid) >= -z else (lo, mid)
        high = lo
    return low, high


def wilson(p, n, z):
    """Wilson's score interval for a proportion p in [0, 1] of n (p may be a mean of values in [0, 1], never a
    count); z > 0, the normal quantile."""
    p, n, z = check_float("p", p, ge=0, le=1), check_int("n", n), check_float("z", z, gt=0)
    centre, half = (p + z * z / (2 * n)), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def newcombe_interval(pa, na, pb, nb, z):
    """Newcombe's (1998) hybrid score interval for p_B - p_A from independent shares pa of na and pb of nb."""
    (la, ua), (lb, ub), d = wilson(pa, na, z), wilson(pb, nb, z), pb - pa
    return d - math.hypot(pb - lb, ua - pa), d + math.hypot(ub - pb, pa - la)


def certified_radius(pA_lower, sigma):
    """Certified l2 radius sigma * Phi^-1(pA_lower) of Cohen et al.'s Theorem 1 (negative below 1/2)."""
    return check_float("sigma", sigma, gt=0) * ndtri(check_array("pA_lower", pA_lower, ge=0, le=1))


def check_counts(nA, N, alpha):
    """The Clopper-Pearson bounds' arguments as float64 arrays that broadcast: 0 <= nA <= N, 1 <= N <= 2^53 whole
    (float64's whole numbers), 0 <= alpha < 1 (0: the trivial bound)."""
    nA, N = check_array("nA", nA, ge=0), check_array("N", N, integral=True, ge=1, le=2 ** 53)
    alpha = check_array("alpha", alpha, ge=0, lt=1)
    try:
        np.broadcast_shapes(nA.shape, N.shape, alpha.shape)
        ok = bool(np.all(nA <= N))
    except ValueError:   # shapes that do not broadcast together
        ok = False
    check(ok, f"nA must lie in 0..N elementwise (shapes {nA.shape}, {N.shape}, {alpha.shape} that broadcast)")
    return nA, N, alpha


# ----------------------------------------------------------------------------------------------------------
# Noise and the Monte Carlo class counter (CERTIFY, PREDICT and training's pA estimates)
# ----------------------------------------------------------------------------------------------------------

def example_generator(seed, idx, device="cpu"):
    """A torch.Generator seeded by (seed, idx): example idx gets the same noise in any run, subset or shard."""
    seeds = [check_int("seed", seed, 0), check_int("idx", idx, 0)]
    state = np.random.SeedSequence(seeds).generate_state(2, dtype=np.uint32)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def gaussian_copies(x, k, sigma, generator=None):
    """k copies x + sigma N(0, I) of each x (B, C, H, W) in x's dtype, (k * B, C, H, W), copy j of b at j * B + b;
    and which draws failed: None, a Gaussian draw never fails (sound_copies' can)."""
    check_tensor("x", x, "B C H W")
    check_smoothing(sigma, k=k)
    check_type("generator", generator, None, torch.Generator)
    noise = sigma * torch.randn((k, *x.shape), device=x.device, generator=generator,   # half types: drawn in fp32
                                dtype=x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32)
    return (x.unsqueeze(0) + noise).to(x.dtype).flatten(0, 1), None


def pass_sizes(n, per_pass):
    """Split n draws into ceil(n / per_pass) passes of (nearly) equal size: no nearly empty last pass."""
    check_int("n", n, 0)
    check_int("per_pass", per_pass)
    passes = -(-n // per_pass)
    q, r = divmod(n, max(passes, 1))
    return [q + 1] * r + [q] * (passes - r) if passes > 0 else []


def modules_of(model, depth=3):
    """The nn.Modules a model is or holds: itself, a bound method's object, a partial's function and arguments, a
    function's closure, defaults and globals, an object's attributes, a dict's or list's items (not Python modules)."""
    if isinstance(model, nn.Module) or depth == 0 or isinstance(model, (types.ModuleType, type)):
        return [model] if isinstance(model, nn.Module) else []
    code, names = getattr(model, "__code__", None), getattr(model, "__globals__", {})
    parts = [getattr(model, "__self__", None), *[c.cell_contents for c in getattr(model, "__closure__", None) or ()],
             *(getattr(model, "__defaults__", None) or ()), *[names.get(n) for n in (code.co_names if code else ())]]
    if isinstance(model, functools.partial):
        parts += [model.func, *model.args, *model.keywords.values()]
    parts += list(model.values()) if isinstance(model, dict) else list(model) if isinstance(model, (list, tuple)) \
        else list(vars(model).values()) if hasattr(model, "__dict__") else []
    return [m for part in parts if part is not model for m in modules_of(part, depth - 1)]


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode for a block (one fixed classifier): every module it is or holds (modules_of), then
    every module back in the mode it came in."""
    modes = [(m, m.training) for held in modules_of(model) for m in held.modules()]
    try:
        for module, _ in modes:
            module.eval()
        yield model
    finally:
        for module, training in modes:
            module.train(training)


def sample_counts(model, x, sigma, n, batch, num_classes, generator=None, copies=gaussian_copies, stop=None):
    """Votes (int64 (B, num_classes), x's device) on n noisy copies of each x (B, C, H, W), about `batch` inputs a pass,
    noise by copies (sound_copies' failed draws vote for none) from generator; stop(counts, drawn) -> True ends."""
    check_smoothed(model, x, generator, "B C H W", read_values=not getattr(x, "is_cuda", False))   # GPU: at the end
    check_smoothing(sigma, n=n, batch=batch, num_classes=num_classes)
    check_type("copies", copies, callable)
    check_type("stop", stop, None, callable)
    B = x.shape[0]
    with torch.inference_mode(), eval_mode(model):
        counts = torch.zeros(B, num_classes + 1, dtype=torch.long, device=x.device)   # + failed draws
        finite, drawn = torch.ones((), dtype=torch.bool, device=x.device), 0
        for k in pass_sizes(n, max(1, batch // B)):
            noisy, failed = copies(x, k, sigma, generator)
            logits = model(noisy)
            check(isinstance(logits, torch.Tensor) and logits.shape == (len(noisy), num_classes),
                  f"the model gave {getattr(logits, 'shape', type(logits).__name__)} for {len(noisy)} inputs; "
                  f"expected ({len(noisy)}, num_classes = {num_classes})")
            finite = finite & torch.isfinite(logits).all()   # on the device: one sync at the end, not per pass
            pred = logits.argmax(1) if failed is None else torch.where(failed, num_classes, logits.argmax(1))
            counts.view(-1).index_add_(0, torch.arange(B, device=x.device).repeat(k) * (num_classes + 1) + pred,
                                       torch.ones_like(pred))
            drawn += k
            if stop is not None and drawn < n and stop(counts[:, :num_classes], drawn):
                break
    check(bool(finite), f"the model gave non-finite outputs on noisy inputs (sigma {sigma}): no certificate")
    return counts[:, :num_classes].clone()   # a normal tensor: callers may update it outside inference mode


# ----------------------------------------------------------------------------------------------------------
# The counter's pass size (certify.py --batch auto): on a GPU the largest pass that fits
# ----------------------------------------------------------------------------------------------------------

CPU_BATCH = 1000             # --batch auto off the GPU: the passes of Cohen et al.'s code
AUTO_MEMORY_SHARE = 0.5      # of the GPU's free memory: headroom for compiled graphs' buffers and fragmentation
EARLY_ABSTAIN_PASSES = 100   # with --early-abstain, whose tests come at pass ends: at least 100 passes of N


def batch_arg(text):
    """--batch's type: 'auto' (auto_batch) or an integer (the command checks that it is >= 1)."""
    if text == "auto" or text.lstrip("-").isdigit():
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}")


def batch_cap(N0, N, input_shape, max_bytes, early_abstain=False):
    """The most inputs --batch auto puts in one pass: the run's largest count (a larger pass is never filled),
    N / EARLY_ABSTAIN_PASSES with early abstention, and max_bytes of float32 noisy inputs."""
    N0, N = check_int("N0", N0, 0), check_int("N", N)
    cap = max(N0, N) if not early_abstain else N // EARLY_ABSTAIN_PASSES
    return max(1, min(cap, max_bytes // (4 * math.prod(input_shape))))


def fitting_batch(pass_bytes, free_bytes, cap, share=AUTO_MEMORY_SHARE, probe=256):
    """The largest k <= cap (at least 1) whose pass fits in share * free_bytes, from two probe passes:
    pass_bytes(k) -> the peak bytes a pass of k inputs allocates, taken as fixed + k * per_input (the fixed part,
    workspaces, counted once)."""
    check(free_bytes >= 0 and 0 < share <= 1 and cap >= 1 and probe >= 1,
          f"fitting_batch needs free_bytes >= 0, share in (0, 1], cap and probe >= 1 "
          f"(got {free_bytes}, {share}, {cap}, {probe})")
    small, large = pass_bytes(probe), pass_bytes(2 * probe)
    per_input = max((large - small) / probe, 1.0)
    fixed = max(small - probe * per_input, 0.0)
    return int(max(1, min(cap, (share * free_bytes - fixed) // per_input)))


def cuda_pass_bytes(model, input_shape, device, precision):
    """pass_bytes(k) for fitting_batch on a CUDA device: the peak memory of one pass of k noisy inputs, as
    sample_counts makes it (noise, noisy inputs, the model's activations), over what was allocated before."""
    def pass_bytes(k):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.inference_mode(), autocast(device.type, precision):
            model(gaussian_copies(torch.zeros(1, *input_shape, device=device), k, 1.0)[0])
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return pass_bytes


def cuda_batch(model, input_shape, device, precision, cap):
    """fitting_batch on a CUDA device (probes of 256 and 512 inputs, smaller where those run out of memory),
    then one pass of that size, halved while it runs out of memory (the allocator may fragment more than the
    probes saw). The model as certify.py has it before folding BatchNorm: its passes take at least as much."""
    pass_bytes = cuda_pass_bytes(model, input_shape, device, precision)
    k = 1
    for probe in sorted({min(256, cap), min(16, cap), 1}, reverse=True):
        try:
            k = fitting_batch(pass_bytes, torch.cuda.mem_get_info(device)[0], cap, probe=probe)
            break
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    while k > 1:
        try:
            pass_bytes(k)
            break
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            k //= 2
    torch.cuda.empty_cache()
    return k


def auto_batch(model, input_shape, device, precision, cap, previous=None):
    """--batch auto as a number: previous (the batch of the log being resumed, so that its examples keep their
    draws' chunking), else on a CUDA device cuda_batch (at most cap), else CPU_BATCH; under torchrun the
    smallest any rank found, on every rank (one sidecar, one chunking)."""
    if isinstance(previous, int) and not isinstance(previous, bool) and previous >= 1:
        batch = previous
    else:
        batch = cuda_batch(model, input_shape, device, precision, cap) if device.type == "cuda" else CPU_BATCH
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        t = torch.tensor([batch])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        batch = int(t)
    return batch


# ----------------------------------------------------------------------------------------------------------
# Errors: bad input is a UserError (a ValueError); the commands turn it into one line and exit code 2
# ----------------------------------------------------------------------------------------------------------

class UserError(ValueError):
    """A problem with the user's input; the message names the problem and the fix."""


def check(condition, message):
    """Raise UserError(message) unless condition holds."""
    if not condition:
        raise UserError(message)


# The blocks' argument checks: a wrong type is a TypeError, a wrong value a UserError (a ValueError), each naming
# the argument; they run before any work, so a bad argument never reaches torch or numpy.
RANGES = {"ge": (">=", np.greater_equal), "gt": (">", np.greater), "le": ("<=", np.less_equal), "lt": ("<", np.less)}


def check_array(name, values, ndim=None, integral=False, finite=True, bools=False, **bounds):
    """values (numbers: one, or a list, array or tensor; not empty) as a float64 array of ndim dimensions (if given),
    finite (else not NaN), whole if integral, within bounds (ge: >=, gt: >, le: <=, lt: <); strings, bools: TypeError."""
    try:
        a = np.asarray((values.detach().cpu().double() if values.is_floating_point() else values.detach().cpu())
                       if isinstance(values, torch.Tensor) else values)   # float64: bf16 has no numpy type
    except ValueError:   # a ragged list
        a = np.asarray(None)
    if a.dtype.kind not in "iuf" + "b" * bools:
        raise TypeError(f"{name} must be numbers, not {values!r:.40} (a {type(values).__name__})")
    check(a.size > 0 and ndim in (None, a.ndim), f"{name} has shape {a.shape}, not {ndim} dimensions, none empty")
    a = a.astype(np.float64)
    ok = (np.isfinite(a) if finite else ~np.isnan(a)) & ((a == np.round(a)) | (not integral))
    for key, bound in bounds.items():
        ok = ok & RANGES[key][1](a, bound)
    check(np.all(ok), f"{name} = {values if a.ndim == 0 else a[~ok][:1]} is out of range: {name} must be "
                      f"{'finite' if finite else 'a number'}{', whole' * integral}" +
                      "".join(f" and {RANGES[k][0]} {b}" for k, b in bounds.items()))
    return a


def check_float(name, value, **bounds):
    """value as a float, finite and within check_array's bounds; a bool or a string is a TypeError."""
    return float(check_array(name, value, ndim=0, **bounds))


def check_int(name, value, low=1, high=None):
    """value as an int in [low, high] (high None: no bound); a bool, a float (even 100.0) or a string is a TypeError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (got {value!r:.40}, a {type(value).__name__})")
    check(low <= value and (high is None or value <= high),
          f"{name} = {value!r}, out of range: {name} >= {low}" + ("" if high is None else f" and <= {high}"))
    return int(value)


def check_choice(name, value, choices):
    """value, one of choices (a string switch's names), else a UserError listing them."""
    check(isinstance(value, str) and value in choices, f"{name} must be one of {', '.join(choices)}, not {value!r:.40}")
    return value


def check_type(name, value, *types):
    """value if an instance of one of types (None: may be None; callable: any function or module), else a TypeError."""
    if not any(t(value) if t is callable else isinstance(value, type(None) if t is None else t) for t in types):
        names = " or ".join(getattr(t, "__name__", "None") for t in types)
        raise TypeError(f"{name} must be {names}, not {value!r:.40}")
    return value


def check_tensor(name, x, shape, kind="float", **sizes):
    """x a torch tensor of `shape` ("C H W": one input, "B C H W": a batch, None: any; sizes fix some, e.g. B=len(x)),
    no dimension empty, of a floating (kind "float") or integer ("int") dtype, else a TypeError."""
    if not isinstance(x, torch.Tensor) or x.is_floating_point() != (kind == "float") or x.is_complex() or \
            x.dtype == torch.bool:
        raise TypeError(f"{name} must be a torch tensor of a {kind} dtype, not {getattr(x, 'dtype', type(x))} (" +
                        (f"8-bit images: {name}.float() / 255)" if kind == "float" else f"labels: {name}.long())"))
    dims = shape.split() if shape else [f"d{i}" for i in range(x.dim())]
    check(x.dim() == len(dims) and all(n >= 1 and n == sizes.get(d, n) for d, n in zip(dims, x.shape)),
          f"{name} has shape {tuple(x.shape)}; expected ({', '.join(dims)}), none empty" +
          "".join(f", {d} = {n}" for d, n in sizes.items()))
    return x


SEPARATORS = {"\t": "a tab", "\n": "a line break", "\r": "a carriage return", "|": "'|'"}


def check_cell(text, what):
    """Refuse (UserError) a label or file name that would break the tables it names: a tab or a line break ends a
    TSV field or row, '|' a Markdown cell."""
    found = [name for sep, name in SEPARATORS.items() if sep in text]
    check(not found, f"{what} {text!r} holds {' and '.join(found)}, which would break the tables it is written into; "
                     f"rename it (or give --labels)")
    return text


def radius_ceiling(log):
    """The largest radius a CERTIFY log's rows can hold, sigma Phi^-1(alpha^(1 / N)) at its largest N, from its
    settings file (log["sidecar"]: sigma, alpha) and N column; infinity where either is unknown, and for a log
    with a sigma per input (DDRS, semi-elastic), whose radii another bound governs."""
    side = log.get("sidecar") or {}
    sigma, alpha, N = side.get("sigma", log.get("sigma")), side.get("alpha"), log.get("N")
    if "sigma_x" in log or not (_is_number(sigma) and _is_number(alpha) and 0 < alpha < 1 and N is not None
                                and len(N)):
        return math.inf
    return float(sigma * ndtri(alpha ** (1 / float(np.max(N)))))


MAX_DRAWS = 10 ** 9   # draws of one input (N, N0, a pass): beyond, one example takes hours on any machine


def check_votes(counts, n, classes, name="sample"):
    """The votes a vote counter (sample_counts, or one given in its place) returned for n draws of one input: a
    (1, classes) integer tensor, each count >= 0, at most n in all (fewer: stopped early); else a ValueError."""
    shape = tuple(getattr(counts, "shape", ()))
    check(isinstance(counts, torch.Tensor) and shape == (1, classes) and not counts.is_floating_point() and
          bool((counts >= 0).all()) and int(counts.sum()) <= n, f"{name} returned {shape or counts!r:.60} for {n} "
          f"draws of one input: not its (1, {classes}) integer votes, at most {n} in all")
    return counts


def check_smoothing(sigma, *alpha, **counts):
    """check_float / check_int of RS's settings: 0 < sigma < inf, 0 < alpha < 1/2 (the chance of a false certificate;
    0.95 is a confidence, not an alpha), each count an int in [1, MAX_DRAWS]."""
    check_float("sigma", sigma, gt=0)
    for a in alpha:   # given by the blocks that bound a probability, CERTIFY's and PREDICT's
        check_float("alpha", a, gt=0, lt=0.5)
    for name, n in counts.items():
        check_int(name, n, 1, MAX_DRAWS)


def check_input_of(model, x, name="x", read_values=True):
    """x on the device and of the dtype of the model's floating parameters (InPrecision: any floating dtype), and
    finite (read_values=False: a CUDA tensor of a training step, which must not wait for the GPU)."""
    p = next((p for held in modules_of(model) for p in held.parameters() if p.is_floating_point()), None)
    check(p is None or x.device == p.device and (x.dtype == p.dtype or hasattr(model, "precision")),
          f"{name} is {x.dtype} on {x.device}, the model's parameters {getattr(p, 'dtype', '')} on "
          f"{getattr(p, 'device', '')}: move {name} to theirs")
    check(not read_values or bool(torch.isfinite(x).all()), f"{name} holds NaN or infinite values: not an input")


def check_smoothed(model, x, generator, shape="C H W", read_values=True):
    """The model, input and noise generator of a smoothing block (check_type, check_tensor, check_input_of)."""
    check_type("model", model, callable)
    check_tensor("x", x, shape)   # a uint8 image is refused: the noise would be cast away
    check_input_of(model, x, read_values=read_values)
    check_type("generator", generator, None, torch.Generator)


def check_labels(y, logits):
    """y within the model's classes (logits' last dimension), read on the CPU only (on a GPU it would stall a step)."""
    k = logits.shape[-1]
    check(y.is_cuda or bool(((y >= 0) & (y < k)).all()), f"y holds labels outside the model's {k} classes 0 .. {k - 1}")


def check_batch(model, x, y, sigma=1.0, **counts):
    """A loss's model, x (B, C, H, W) floating point, y (B,) integer labels, sigma > 0 and counts (ints >= 1)."""
    check_type("model", model, callable)
    check_tensor("x", x, "B C H W")
    check_tensor("y", y, "B", "int", B=len(x))
    check_input_of(model, x, read_values=not x.is_cuda)   # a CUDA tensor's values: read only by the loss itself
    check(y.is_cuda or bool((y >= 0).all()), "y holds negative labels (cross-entropy would skip -100): y must be "
                                              "classes 0, 1, ...")
    if isinstance(sigma, torch.Tensor):   # DDRS's and MACER's, one per image, shaped to broadcast over x
        check(sigma.is_floating_point() and sigma.shape == (len(x),) + (1,) * (x.dim() - 1),
              f"sigma has shape {tuple(sigma.shape)}; one per image is shape {(len(x),) + (1,) * (x.dim() - 1)}")
        check(sigma.is_cuda or bool((torch.isfinite(sigma) & (sigma > 0)).all()), "sigma holds values that are not "
                                                                                   "finite and > 0")
    else:
        check_float("sigma", sigma, gt=0)
    for name, n in counts.items():
        check_int(name, n)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ----------------------------------------------------------------------------------------------------------
# Sound sampling (Voráček & Hein 2023): integer noise on the 8-bit grid, one conversion to float
# ----------------------------------------------------------------------------------------------------------
# The float path feeds f with fl(x + fl(sigma * randn)), which keeps low-order bits of x: a base classifier
# can read them and get certificates that are false (Voráček & Hein 2023, §3). The sound path draws the Gaussian rounded
# to the grid h = 1/255 (J = round(G / h)) by comparing fair 62-bit integers with integer thresholds, adds
# it to the input's integer levels (a + J) and converts once, z = fp32(a + J) / 255. Since x + q_h(G) =
# q_h(x + G) for x on the grid, the votes are those of the Gaussian smoothing of f o phi o q_h, so Cohen's
# radius holds unchanged for that classifier. A draw whose integer falls past the last threshold (about
# 1e-16 to 5e-16 per coordinate for sigma 0.25 to 1) is a failure and votes for no class: never A, and counted
# in the full N.

SOUND_Q = 2 ** 62       # the uniform integers compared with the thresholds: 62 fair coin flips per coordinate
GRID_LEVELS = 255       # 8-bit inputs x = a / 255
# The grid each dataset's inputs lie on: 8-bit images, and scikit-learn's digits with their 17 levels k / 16.
DATASET_LEVELS = {"cifar10": 255, "imagenet": 255, "digits": 16}


@functools.lru_cache(maxsize=16)
def rounded_gaussian_table(sigma, Q=SOUND_Q, levels=GRID_LEVELS):
    """Cumulative integer thresholds S of the Gaussian N(0, sigma^2) rounded to the grid h = 1 / levels.

    Bin j (|j| <= L = ceil(10 sigma / h)) has exact mass p_j = Phi((j + 1/2) h / sigma) - Phi((j - 1/2) h /
    sigma) and gets W_j = floor(Q p_j) of the Q integers, so no bin is sampled more often than its exact mass.
    Precision: the floors are computed with mpmath at 50 and at 80 significant digits and must agree; Q p_j
    is at most 2^62 < 10^19, so 50 digits leave 30 after the point, and a floor can only differ between the
    two precisions if Q p_j lies within about 1e-30 of an integer, which the check would catch. sigma is taken
    at its exact binary value. Returns (S, L): S an int64 tensor (2L + 1,) of cumulative sums of W on CPU.
    """
    import mpmath
    L = math.ceil(10 * sigma * levels)

    def floors(digits):
        with mpmath.workdps(digits):
            scale = mpmath.mpf(1) / (levels * mpmath.mpf(sigma))      # h / sigma
            cdf = [mpmath.ncdf((j + mpmath.mpf(1) / 2) * scale) for j in range(-L - 1, L + 1)]
            return [int(mpmath.floor(Q * (b - a))) for a, b in zip(cdf, cdf[1:])]

    W = floors(50)
    if W != floors(80):
        raise ArithmeticError(f"rounded Gaussian table for sigma {sigma}: floors differ between precisions")
    return torch.tensor(np.cumsum(np.array(W, dtype=object)).astype(np.int64)), L


@functools.lru_cache(maxsize=16)
def _table_on(sigma, device, Q=SOUND_Q, levels=GRID_LEVELS):
    S, L = rounded_gaussian_table(sigma, Q, levels)
    return S.to(device), L


def grid_levels(x, levels=GRID_LEVELS):
    """The integer levels a = round(levels * x) of an input on the grid x = a / levels (int32, x's shape and
    device; levels = 255 for 8-bit images, DATASET_LEVELS per dataset).

    An input off the grid (|levels x - a| >= 1e-3 anywhere) is a UserError: the sound sampler certifies only
    inputs on the grid (ToTensor of 8-bit images; our datasets)."""
    check_tensor("x", x, None)
    check_int("levels", levels)
    scaled = x.double() * levels
    a = scaled.round()
    on_grid = ((scaled - a).abs().max() < 1e-3) & (a.min() >= 0) & (a.max() <= levels)   # one host sync, not three
    check(bool(on_grid), f"--sound needs inputs on the grid x = a / {levels}, a in 0..{levels} (this input is not)")
    return a.to(torch.int32)


def sound_noisy_inputs(a, k, sigma, generator=None, Q=SOUND_Q, levels=GRID_LEVELS):
    """k noisy copies of each input on the grid, formed exactly: z = fp32(a + J) / levels (docs/certification.md, --sound).

    a: int32 levels (B, C, H, W) (grid_levels). J: the rounded Gaussian drawn with integer thresholds on a's
    device. Returns (z (k, B, C, H, W) float32, failed (k, B) bool: a draw with any failed coordinate).
    """
    check_tensor("a", a, None, "int")   # (B, C, H, W), or any (B, ...)
    check_smoothing(sigma, k=k)
    check_int("Q", Q, 2, 2 ** 62)   # the thresholds are int64: U < Q and its sums stay exact
    check_int("levels", levels)
    check_type("generator", generator, None, torch.Generator)
    check(bool(((a >= 0) & (a <= levels)).all()), f"a holds values outside the grid's levels 0 .. {levels}")
    S, L = _table_on(sigma, a.device, Q, levels)
    U = torch.randint(0, Q, (k, *a.shape), dtype=torch.int64, device=a.device, generator=generator)
    index = torch.searchsorted(S, U, right=True, out_int32=True)  # bin of U; len(S) means past the last one
    failed = (index == len(S)).reshape(k, a.shape[0], -1).any(2)
    z = (a.unsqueeze(0) + (index - L)).float() / levels           # integer sum (int32), one conversion
    return z, failed


def sound_copies(levels=GRID_LEVELS):
    """The `copies` of sample_counts for inputs on the grid x = a / levels: sound_noisy_inputs' exact
    integer noise (certify.py --sound). Its failed draws vote for no class."""
    check_int("levels", levels)

    def copies(x, k, sigma, generator=None):
        z, failed = sound_noisy_inputs(grid_levels(x, levels), k, sigma, generator, levels=levels)
        return z.flatten(0, 1).to(x.dtype), failed.flatten()   # a cast of the grid point: part of the classifier
    return copies


# ----------------------------------------------------------------------------------------------------------
# Reduced precision: the base classifier under bf16 / fp16 autocast (certify.py --precision)
# ----------------------------------------------------------------------------------------------------------

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device_type, precision="fp32"):
    """The autocast context of a precision: fp32 is a no-op, bf16/fp16 run matmuls and convolutions in it."""
    dtype = PRECISIONS[check_choice("precision", precision, tuple(PRECISIONS))]
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


class InPrecision(nn.Module):
    """model evaluated under autocast(precision): the reduced-precision classifier that a certificate computed
    with it is about (the model itself unchanged; pass the result to certify, predict or grid_certify)."""

    def __init__(self, model, precision):
        super().__init__()
        self.model, self.precision = model, precision

    def forward(self, x):
        with autocast(x.device.type, self.precision):
            return self.model(x)


def in_precision(model, precision):
    """model as it is for fp32, else InPrecision(model, precision)."""
    check_type("model", model, callable)
    check_choice("precision", precision, tuple(PRECISIONS))
    return model if precision == "fp32" else InPrecision(model, precision)


# ----------------------------------------------------------------------------------------------------------
# The adaptive attack on the noise sphere (Alg. 1, App. C.3; as the paper's released code runs it, docs/training.md)
# ----------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def frozen_eval(model):
    """Run attacks in eval mode (BatchNorm statistics untouched) with frozen parameters (no weight gradients); then
    every module gets back its own mode (not only the top one's) and every parameter its requires_grad."""
    held = modules_of(model)   # a model wrapped in a function: the modules it holds
    modes = [(m, m.training) for h in held for m in h.modules()]   # each module's own: a frozen BatchNorm stays eval
    params = [p for h in held for p in h.parameters()]
    flags = [p.requires_grad for p in params]
    for module, _ in modes:
        module.eval()
    for p in params:
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
        for module, training in modes:
            module.train(training)


def sphere_pgd(model, x, y, delta, T, eps, norm_type="l2"):
    """Move each Gaussian noise along its sphere ||delta|| = const to make the base model err (Alg. 1).

    x: (B, C, H, W); y: (B,); delta: (m, B, C, H, W), the m noise draws. T PGD steps on the cross-entropy with
    step eps, l2 the normalised gradient, linf its sign over sqrt(d) (the official code's), each draw rescaled to
    its norm after each step. A draw keeps its first misclassified iterate, else the last (T = 0: delta). The model
    runs under frozen_eval (weights and BatchNorm statistics kept). Returns a new detached tensor like delta.
    """
    check_batch(model, x, y)
    check_tensor("delta", delta, "m B C H W", B=len(x))
    check(delta.shape[2:] == x.shape[1:] and delta.dtype == x.dtype and delta.device == x.device, f"delta's draws are "
          f"{tuple(delta.shape[2:])} {delta.dtype} on {delta.device}, x {tuple(x.shape)} {x.dtype} on {x.device}")
    check_int("T", T, 0)
    check_float("eps", eps, ge=0)
    check_choice("norm_type", norm_type, ("l2", "linf"))
    if T == 0:
        return delta.detach().clone()
    model = unwrap(model)  # under DDP: attack the plain module, no gradient synchronisation
    m, B = delta.shape[:2]
    d = x[0].numel()
    with frozen_eval(model):
        xs, ys = x.unsqueeze(0).expand_as(delta).flatten(0, 1), y.repeat(m)    # block order (m*B, ...)
        r0 = delta.flatten(2).norm(dim=2).view(m * B, *[1] * (x.dim() - 1))    # (m*B, 1, 1, 1)
        cur = delta.detach().flatten(0, 1).clone()
        best = cur.clone()
        found = torch.zeros(m * B, dtype=torch.bool, device=x.device)
        for _ in range(T):
            cur.requires_grad_(True)
            logits = model(xs + cur)
            check_labels(y, logits)
            wrong = (logits.argmax(1) != ys) & ~found                          # first misclassification
            best = torch.where(wrong.view_as(r0), cur.detach(), best)          # no host sync (vs. masking)
            found |= wrong
            loss = F.cross_entropy(logits, ys, reduction="sum") / m
            grad, = torch.autograd.grad(loss, cur)
            with torch.no_grad():
                if norm_type == "l2":
                    step = grad / (grad.flatten(1).norm(dim=1).view_as(r0) + 1e-8)
                else:
                    step = grad.sign() / d ** 0.5
                cur = cur.detach() + eps * step
                cur = cur * r0 / (cur.flatten(1).norm(dim=1).view_as(r0) + 1e-8)  # back onto the sphere
        best = torch.where(found.view_as(r0), best, cur.detach())
        return best.view_as(delta)


# ----------------------------------------------------------------------------------------------------------
# The shared training loop (App. C.1): SGD, step schedule, m-chunk convention, noisy evaluation, logs
# ----------------------------------------------------------------------------------------------------------


def make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-4):
    """Plain SGD with momentum, as in every official RS training script."""
    check_type("model", model, torch.nn.Module)
    check_float("lr", lr, gt=0)
    check_float("momentum", momentum, ge=0)
    check_float("weight_decay", weight_decay, ge=0)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def make_scheduler(optimizer, lr_step, gamma=0.1, milestones=None):
    """lr x gamma every lr_step epochs, or at each of the epochs in `milestones` when given; stepped once at
    the end of each epoch (so the first decay applies from epoch lr_step, or milestones[0], on)."""
    check_type("optimizer", optimizer, torch.optim.Optimizer)
    check_int("lr_step", lr_step)
    check_float("gamma", gamma, gt=0, le=1)
    if milestones is not None and len(milestones):
        milestones = check_array("milestones", milestones, ndim=1, integral=True, ge=1).astype(int).tolist()
        check(len(set(milestones)) == len(milestones), f"milestones {milestones} repeat an epoch (its decay would "
                                                       f"apply twice)")
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=sorted(milestones), gamma=gamma)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=lr_step, gamma=gamma)


def split_chunks(batch, m):
    """Cut a loader batch into m consecutive chunks of floor(B/m) examples (Salman et al. 2019's convention, docs/training.md).

    Each chunk is replicated with m noise draws and gets its own optimizer step, so every step sees about
    B noisy inputs. Leftover examples of a batch not divisible by m are dropped, as in the official code.
    """
    check(isinstance(batch, (list, tuple)) and batch and all(isinstance(t, torch.Tensor) and len(t) == len(batch[0])
                                                            for t in batch), "batch must be tensors of one length")
    check_int("m", m)
    b = batch[0].shape[0] // m
    if b == 0:
        return [batch]  # a batch smaller than m (tiny last batch): train on it whole
    return [tuple(t[i * b:(i + 1) * b] for t in batch) for i in range(m)]


def seed_everything(seed):
    """Seed Python's, numpy's and torch's global generators (seed: an int >= 0)."""
    seed = check_int("seed", seed, 0)
    import random
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def epoch_seed(seed, epoch, stream=0):
    """An integer seed derived from (seed, epoch, stream); streams separate the sampler from each rank's noise."""
    parts = [check_int("seed", seed, 0), check_int("epoch", epoch, 0), check_int("stream", stream, 0)]
    state = np.random.SeedSequence(parts).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


EVAL_STREAM = 2 ** 21   # epoch_seed stream of the noisy test evaluation


def eval_generator(seed, epoch, device):
    """The generator of epoch `epoch`'s noisy test evaluation: seeded by (seed, epoch) alone."""
    g = torch.Generator(device=device)
    g.manual_seed(epoch_seed(seed, epoch, EVAL_STREAM))
    return g


def seed_epoch(seed, epoch, rank=0):
    """Reseed all global generators at the start of an epoch (noise, attacks); rank: this process's under torchrun.

    Each epoch's randomness then depends only on (seed, epoch, rank), so a run resumed at an epoch
    boundary draws exactly what the uninterrupted run drew.
    """
    seed_everything(epoch_seed(seed, epoch, 1 + check_int("rank", rank, 0)))   # stream 0 is the sampler's


AUGMENT_STREAM = 2 ** 20   # epoch_seed stream of the augmentation seeds (0: the sampler, 1 + rank: the noise)


class EpochSampler(torch.utils.data.Sampler):
    """The current epoch's draws as (index, augmentation seed) pairs; TrainLoader.epoch sets them."""

    def __init__(self):
        self.items = []

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


class TrainLoader:
    """The training loader of a whole run: one DataLoader whose sampler is set anew each epoch.

    Reusing one loader lets its worker processes live across epochs (persistent_workers: no restart and
    dataset re-read at every epoch, which keeps a GPU fed). Exact resume does not depend on the workers'
    state: each draw's augmentation is seeded from (seed, epoch, its position in the epoch) wherever it is
    loaded, so an epoch's batches depend only on (seed, epoch), not on --workers or on earlier epochs.
    Use: loaders = TrainLoader(train_set, batch, workers, seed); each epoch: loader = loaders.epoch(epoch).
    rank, world: this process's rank and the number of processes under torchrun (each takes its share).
    """

    def __init__(self, dataset, batch, workers, seed, rank=0, world=1):
        check_int("batch", batch)
        check_int("workers", workers, 0)
        check_int("seed", seed, 0)
        self.dataset, self.seed, self.sampler = dataset, seed, EpochSampler()
        self.rank, self.world = check_int("rank", rank, 0), check_int("world", world, 1)
        check(rank < world, f"rank must lie below world ({world}), got {rank}")
        # Under torchrun every rank gets batch // world_size examples per batch. The loader's own generator
        # keeps its per-epoch seed draw out of the global stream (the training noise).
        self.loader = torch.utils.data.DataLoader(
            WithIndex(dataset), batch_size=max(1, batch // world), sampler=self.sampler, num_workers=workers,
            persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
            generator=torch.Generator().manual_seed(epoch_seed(seed, 0, AUGMENT_STREAM + 1)))

    def epoch(self, epoch, indices=None, weights=None, num_samples=None):
        """The loader of one training epoch; it yields (x, y, idx) with idx the example's index in the dataset.

        indices=None gives one shuffled pass. Otherwise the epoch draws num_samples examples (default
        len(dataset): Alg. 2 keeps |D| draws per epoch after discarding) with replacement from `indices`
        (e.g. the kept examples), uniformly, or proportionally to `weights` (one non-negative weight per entry
        of indices). The draws, their order and their augmentation depend only on (seed, epoch), so a resumed
        run sees the same batches. Under torchrun every rank gets an equal share of the draws.
        """
        check_int("epoch", epoch, 0)
        check(indices is not None or (weights is None and num_samples is None),
              "weights and num_samples go with indices (the examples to draw from)")
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch, 0))  # stream 0: the same on every rank
        if indices is None:
            order = torch.randperm(len(self.dataset), generator=g)
        else:
            check(len(indices) > 0, "no training examples left to sample from (every example was discarded)")
            indices = torch.as_tensor(check_array("indices", indices, ndim=1, integral=True, ge=0,
                                                  lt=len(self.dataset)), dtype=torch.long)
            num_samples = len(self.dataset) if num_samples is None else check_int("num_samples", num_samples)
            if weights is not None:
                weights = check_array("weights", weights, ndim=1, ge=0)
                check(len(weights) == len(indices) and weights.sum() > 0, f"weights: one per entry of indices "
                                                                          f"({len(indices)}), not all 0")
            if weights is None:
                pick = torch.randint(len(indices), (num_samples,), generator=g)
            else:
                pick = torch.multinomial(torch.as_tensor(weights, dtype=torch.double), num_samples, True, generator=g)
            order = indices[pick]
        base = epoch_seed(self.seed, epoch, AUGMENT_STREAM) % 2 ** 62
        items = [(i, base + k) for k, i in enumerate(order.tolist())]   # by position: a repeated draw differs
        if self.world > 1:
            items = items[self.rank::self.world][:len(items) // self.world]
        self.sampler.items = items
        return self.loader


def make_test_loader(dataset, batch, workers):
    """Plain in-order loader of (x, y) for evaluation."""
    # its own generator: starting the workers then draws nothing from the global one (the training noise)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=False, num_workers=workers,
                                       persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
                                       generator=torch.Generator().manual_seed(0))


GRAPH_WARMUP = 2   # eager steps of a chunk shape each epoch before its step is captured (cuDNN's picks, momentum)


def check_graph(device, precision, world=1):
    """The conditions of a CUDA-graphed training step (train_epoch(graph=True), --cuda-graph): CUDA, fp32 or bf16,
    one process (world: the number under torchrun)."""
    check_type("device", device, torch.device)
    check(device.type == "cuda", f"--cuda-graph needs a CUDA device (got {device})")
    check(precision != "fp16", "--cuda-graph cannot replay fp16's loss scaling (the scaler reads its overflow check "
                               "on the host); use --amp bf16, which needs no scaling")
    check(world == 1, "--cuda-graph trains in one process; under torchrun drop --cuda-graph")


class GraphedStep:
    """One training step (loss_fn under autocast, backward, optimizer.step) captured as a CUDA graph on static
    copies of a chunk (x, y, idx), then replayed for every chunk of that shape: the GPU runs the step's
    kernels back to back instead of waiting for the host to launch each of the thousands a ResNet-110 step
    makes. The replay runs the captured kernels on the same parameters, gradients and momentum buffers (all
    updated in place), so it computes the eager step; its random draws come from the global CUDA generator,
    which each replay advances as the eager step would. loss_fn must not synchronise with the host (.item(),
    shapes that depend on values): gaussian_loss and ours_loss do not. Call it after GRAPH_WARMUP eager steps of
    that shape on a side stream (torch.cuda.graph's rule), so that nothing is first allocated inside."""

    def __init__(self, model, optimizer, loss_fn, precision, chunk):
        self.inputs = tuple(t.clone() for t in chunk)
        self.graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)   # the captured backward then writes the gradients, not adds to them
        with torch.cuda.graph(self.graph):
            with autocast("cuda", precision):
                self.out = loss_fn(model, *self.inputs)
            self.out["loss"].backward()
            optimizer.step()

    def __call__(self, chunk):
        for static, t in zip(self.inputs, chunk):
            static.copy_(t)
        self.graph.replay()
        return self.out


def eager_step(model, optimizer, loss_fn, device, precision, scaler, x, y, idx):
    """One plain training step of train_epoch: loss_fn under autocast, backward, optimizer step (through the
    GradScaler under fp16, which skips the step when the scaled gradients overflowed). Returns loss_fn's dict."""
    with autocast(device.type, precision):
        out = loss_fn(model, x, y, idx)
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        out["loss"].backward()
        optimizer.step()
    else:
        scaler.scale(out["loss"]).backward()
        scaler.step(optimizer)
        scaler.update()
    return out


def train_epoch(model, loader, optimizer, loss_fn, chunks, device, progress=None, max_batches=None, *,
                precision="fp32", graph=False):
    """One training epoch: every loader batch is split into `chunks` chunks, one optimizer step each.

    loss_fn(model, x, y, idx) -> dict with 'loss' (scalar tensor to minimise), 'correct' (tensor: correct
    predictions among its noisy inputs) and 'total' (int: number of noisy inputs). Loss and accuracy are
    accumulated on the device (no per-step host synchronisation). Returns {'train_loss', 'train_acc'}.
    progress: optional callable(batches_done, batches_total) for a progress line. max_batches: stop after
    that many loader batches (smoke tests and timing; None = the whole epoch). precision: 'fp32', or
    'bf16'/'fp16' autocast of loss_fn (mixed precision, --amp); fp16 scales the loss (a GradScaler per
    epoch, so a run resumed at an epoch boundary repeats the uninterrupted one). graph (CUDA, one process,
    fp32 or bf16; --cuda-graph): after GRAPH_WARMUP eager steps of a chunk shape, its steps replay a
    GraphedStep (the same steps; the graphs live for this epoch only, as the learning rate is baked in).
    """
    check_type("model", model, torch.nn.Module)
    check_type("optimizer", optimizer, torch.optim.Optimizer)
    check_type("loss_fn", loss_fn, callable)
    check_int("chunks", chunks)
    check_type("device", device, torch.device)
    check_type("progress", progress, None, callable)
    if max_batches is not None:
        check_int("max_batches", max_batches)
    check_choice("precision", precision, tuple(PRECISIONS))
    check_type("graph", graph, bool)
    own = {id(p) for p in unwrap(model).parameters()}
    check(all(id(p) in own for group in optimizer.param_groups for p in group["params"]),
          "optimizer holds parameters that are not the model's: it would step another model")
    if graph:
        check_graph(device, precision, 2 if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
                    else 1)
    model.train()
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None  # bf16 has fp32's range
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    total, steps = 0, 0
    graphs, eager_steps = {}, {}   # chunk shape -> its GraphedStep, its eager steps so far
    side = torch.cuda.Stream(device) if graph else None
    eager = functools.partial(eager_step, model, optimizer, loss_fn, device, precision, scaler)
    n_batches = len(loader) if max_batches is None else min(max_batches, len(loader))
    for i, batch in enumerate(loader):
        if i >= n_batches:
            break
        batch = tuple(t.to(device, non_blocking=True) for t in batch)
        for chunk in split_chunks(batch, chunks):
            shape = tuple(chunk[0].shape)
            if graph and shape not in graphs and eager_steps.get(shape, 0) >= GRAPH_WARMUP:
                graphs[shape] = GraphedStep(model, optimizer, loss_fn, precision, chunk)
            if shape in graphs:
                out = graphs[shape](chunk)
            elif graph:   # warm-up steps on a side stream, as capture requires
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    out = eager(*chunk)
                torch.cuda.current_stream(device).wait_stream(side)
                eager_steps[shape] = eager_steps.get(shape, 0) + 1
            else:
                out = eager(*chunk)
            loss_sum += out["loss"].detach()
            correct += out["correct"]
            total += out["total"]
            steps += 1
        if progress is not None:
            progress(i + 1, n_batches)
    check(steps > 0, "the loader gave no batches: nothing was trained")
    if graphs:
        optimizer.zero_grad(set_to_none=True)   # the last replay's gradients live in the graphs' memory
    train_loss = (loss_sum / max(steps, 1)).item()
    lr = optimizer.param_groups[0]["lr"]
    check(math.isfinite(train_loss), f"the training loss became {train_loss} at learning rate {lr:g} (this "
                                     f"epoch's, from --lr and the schedule): the run diverged; stopped before "
                                     f"saving, so the checkpoint of the last good epoch is kept")
    return {"train_loss": train_loss, "train_acc": (correct / max(total, 1)).item()}


def step_model(model, compile_model=False):
    """The model the training steps call (--compile): model itself, or torch.compile(model), which shares its
    parameters and buffers, so the optimizer, the checkpoint and the evaluation keep using model. The compiled
    steps compute the same training up to float rounding; compilation happens at the first step (minutes on
    ResNet-110), once more for the attack's eval-mode passes. One process only: DistributedDataParallel's
    gradient hooks are not compiled here."""
    check(isinstance(model, nn.Module), f"step_model needs an nn.Module (got {type(model).__name__})")
    if not compile_model:
        return model
    check(not isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)),
          "--compile trains in one process; under torchrun drop --compile")
    return torch.compile(model)


def gaussian_loss(model, x, y, sigma, m):
    """Gaussian data augmentation (Cohen et al.): mean cross-entropy over m noisy copies, block order.

    x: (b, C, H, W), y: (b,). Returns the loss_fn dict of train_epoch.
    """
    check_batch(model, x, y, sigma, m=m)
    noisy = (x.unsqueeze(0) + sigma * torch.randn(m, *x.shape, device=x.device, dtype=x.dtype)).flatten(0, 1)
    logits = model(noisy)
    check_labels(y, logits)
    targets = y.repeat(m)
    loss = F.cross_entropy(logits, targets)
    return {"loss": loss, "correct": (logits.argmax(1) == targets).sum(), "total": len(targets)}


@torch.no_grad()
def evaluate_noisy(model, loader, sigma, device, generator=None):
    """Loss and accuracy of the base classifier on one Gaussian-noised copy of each test input.

    generator: the noise's own torch.Generator on `device` (seed it from (seed, epoch)): then the noise
    depends neither on the loader's workers nor on what ran before, and a resumed run logs what an
    uninterrupted one logs."""
    check_type("model", model, torch.nn.Module)
    check_float("sigma", sigma, ge=0)   # 0: the clean accuracy
    check_type("device", device, torch.device)
    check_type("generator", generator, None, torch.Generator)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    total = 0
    with eval_mode(model):
        for batch in loader:
            x = batch[0].to(device)
            check_batch(model, x, batch[1])   # the labels read on the CPU, where the loader gives them
            y = batch[1].to(device)
            logits = model(x + sigma * torch.randn(x.shape, device=device, generator=generator))
            check_labels(y, logits)
            loss_sum += F.cross_entropy(logits, y, reduction="sum")
            correct += (logits.argmax(1) == y).sum()
            total += len(y)
    check(total > 0, "the test loader gave no examples")
    return {"test_loss": (loss_sum / total).item(), "test_acc_noisy": (correct / total).item()}


# ----------------------------------------------------------------------------------------------------------
# Per-example measurements of the training scripts: pA estimates (Alg. 2) and gradient norms (Table 2)
# ----------------------------------------------------------------------------------------------------------


def unwrap(model):
    """The plain model inside a DistributedDataParallel/DataParallel wrapper (attacks, evaluation, saving)."""
    return model.module if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else model


@torch.no_grad()
def count_correct(model, dataset, indices, sigma, n, batch, workers=0):
    """For each example dataset[i], i in indices: how many of n noisy copies the model labels correctly.

    The training-time pA estimate of Alg. 2 (an empirical frequency of the TRUE label, not a bound): the
    model in eval mode (handed back as it came), the examples as `dataset` yields them (with its augmentation,
    as the official code), noise from the global generator. Returns int64 counts (len(indices),) and the
    labels, both on the CPU."""
    check_type("model", model, torch.nn.Module)
    check(hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and len(dataset) > 0,
          f"dataset must be a non-empty dataset (got a {type(dataset).__name__})")
    indices = check_array("indices", indices, ndim=1, integral=True, ge=0, lt=len(dataset)).astype(np.int64)
    check_smoothing(sigma, n=n, batch=batch)
    check_int("workers", workers, 0)
    net = unwrap(model)
    device = next(net.parameters()).device
    subset = torch.utils.data.Subset(dataset, [int(i) for i in indices])
    per_batch = max(1, batch // n)  # examples per forward pass, each with (up to) batch noisy copies
    loader = torch.utils.data.DataLoader(subset, batch_size=per_batch, shuffle=False, num_workers=workers)
    counts, labels, num_classes = [], [], None
    with eval_mode(net):
        for x, y in loader:
            check_batch(net, x.to(device), y)   # the labels read on the CPU, where the dataset gives them
            x, y = x.to(device), y.to(device)
            num_classes = num_classes or net(x[:1]).shape[1]
            check_labels(y, torch.empty(0, num_classes))
            votes = sample_counts(net, x, sigma, n, batch, num_classes)  # (B, K)
            counts.append(votes.gather(1, y.view(-1, 1)).squeeze(1).cpu())
            labels.append(y.cpu())
    return torch.cat(counts), torch.cat(labels)


def per_example_grad_norms(model, loss_fn, x, y, idx=None):
    """l2 norm of the gradient of each example's own training loss w.r.t. the model parameters (Table 2).

    loss_fn(model, x, y, idx) -> {'loss', ...}: any train_epoch loss, called on one example at a time (its
    noise copies and attacks happen inside). The model is in eval mode, so BatchNorm uses its running
    statistics and an example's gradient does not depend on the rest of its batch. x: (B, C, H, W);
    y, idx: (B,). Returns a float64 tensor (B,) on CPU; the parameters' .grad fields are not touched.
    """
    check_batch(model, x, y)
    check_type("model", model, torch.nn.Module)
    check_type("loss_fn", loss_fn, callable)
    check(idx is None or len(idx) == len(x), f"idx holds {0 if idx is None else len(idx)} indices for {len(x)} "
                                             f"examples: one each")
    net = unwrap(model)
    params = [p for p in net.parameters() if p.requires_grad]
    norms = []
    with eval_mode(net):
        for i in range(len(x)):
            out = loss_fn(net, x[i:i + 1], y[i:i + 1], None if idx is None else idx[i:i + 1])
            grads = torch.autograd.grad(out["loss"], params, allow_unused=True)
            norms.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)).item())
    return torch.tensor(norms, dtype=torch.float64)


def probe_grad_norms(model, dataset, loss_fn, sigma, probe, n, seed, batch):
    """Table 2's measurement: pA and the gradient norm of the training loss on a fixed probe set.

    Probe set: the first `probe` examples of a permutation of `dataset` seeded by `seed` (pass the training
    set without augmentation). pA: the fraction of n noisy copies labelled correctly (count_correct, noise
    from the global generators, seeded by `seed`). grad_norm: per_example_grad_norms of loss_fn. Returns
    {"idx", "label", "pA", "grad_norm"}: lists, one entry per probe example.
    """
    check_int("probe", probe, 1, len(dataset))   # never fewer probes than asked, silently
    check_int("seed", seed, 0)
    seed_everything(seed)
    probe_idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:probe]
    counts, labels = count_correct(model, dataset, probe_idx, sigma, n, batch)
    device = next(unwrap(model).parameters()).device
    xs = torch.stack([dataset[int(i)][0] for i in probe_idx]).to(device)
    norms = per_example_grad_norms(model, loss_fn, xs, labels.to(device), probe_idx.to(device))
    return {"idx": probe_idx.tolist(), "label": labels.tolist(), "pA": (counts.double() / n).tolist(),
            "grad_norm": norms.tolist()}
