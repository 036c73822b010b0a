"""Shared building blocks of randomized smoothing (RS): models, data, noise, statistics, checkpoints, training.

Everything the paper's numbers rest on lives here exactly once: the architectures of Cohen et al. (2019),
the datasets, the Gaussian noise, the adaptive attack on the noise sphere (Alg. 1), the one-sided
Clopper-Pearson bound and the certified radius (Thm. of Cohen et al.), the Monte Carlo class counter that
CERTIFY and the training-time pA estimates share, atomic checkpoints and the shared training loop.
No argparse here and nothing runs on import: copy any function into a notebook.
"""
import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import beta as beta_dist
from scipy.stats import norm

DATASETS = ("cifar10", "imagenet", "digits")
ARCHS = ("cifar_resnet20", "cifar_resnet110", "resnet50", "lenet", "digits_cnn")
DEFAULT_ARCH = {"cifar10": "cifar_resnet110", "imagenet": "resnet50", "digits": "digits_cnn"}
NUM_CLASSES = {"cifar10": 10, "imagenet": 1000, "digits": 10}
INPUT_SHAPE = {"cifar10": (3, 32, 32), "imagenet": (3, 224, 224), "digits": (1, 8, 8)}
# Normalisation constants of the released checkpoints' code (Cohen et al. and successors).
MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "imagenet": (0.485, 0.456, 0.406), "digits": (0.3,)}
STD = {"cifar10": (0.2023, 0.1994, 0.2010), "imagenet": (0.229, 0.224, 0.225), "digits": (0.38,)}


# ----------------------------------------------------------------------------------------------------------
# Errors: bad input is one line on stderr and exit code 2, never a traceback
# ----------------------------------------------------------------------------------------------------------

class UserError(Exception):
    """A problem with the user's input; the message names the problem and the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line on stderr (exit code 2)."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def run(main):
    """Call main(); a UserError becomes one line on stderr and exit code 2."""
    try:
        main()
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


def check(condition, message):
    """Raise UserError(message) unless condition holds."""
    if not condition:
        raise UserError(message)


# ----------------------------------------------------------------------------------------------------------
# Models: Sequential(NormalizeLayer, net), with the parameter names of Cohen et al.'s released checkpoints
# ----------------------------------------------------------------------------------------------------------

class NormalizeLayer(nn.Module):
    """(x - mean) / std per channel. Non-persistent buffers: state_dicts keep Cohen's keys (`1.conv1.weight`)."""

    def __init__(self, mean, std):
        super().__init__()
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


def get_architecture(arch, dataset):
    """The base classifier f: Sequential(NormalizeLayer(mean, std), net); inputs live in [0, 1] pixel space."""
    check(arch in ARCHS, f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    check(dataset in DATASETS, f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
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
    _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    i, j = torch.randint(0, 2 * padding + 1, (2,)).tolist()
    x = padded[:, i:i + h, j:j + w]
    return x.flip(2) if torch.rand(()) < 0.5 else x


def _digits(split):
    """scikit-learn's bundled 8x8 digits in [0, 1], a fixed seeded 80/20 train/test split (no network)."""
    from sklearn.datasets import load_digits
    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
    labels = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(labels))
    part = perm[:cut] if split == "train" else perm[cut:]
    return TensorImages(images[part], labels[part])


def _image_folder_in_memory(folder):
    """Decode a small-image folder tree (`<class>/*.jpg`, classes sorted by name) into memory once."""
    from PIL import Image
    classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    images, labels = [], []
    for label, name in enumerate(classes):
        for fname in sorted(os.listdir(os.path.join(folder, name))):
            with Image.open(os.path.join(folder, name, fname)) as img:
                images.append(np.asarray(img.convert("RGB"), dtype=np.uint8))
            labels.append(label)
    images = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div_(255)  # (N, 3, H, W)
    return images, torch.tensor(labels, dtype=torch.long)


def _cifar10(split, data_dir, train_transform):
    folder = os.path.join(data_dir, "train" if split == "train" else "test")
    transform = random_crop_flip if train_transform and split == "train" else None
    if os.path.isdir(folder):  # image-folder layout, e.g. the JPEG copy on offline machines
        images, labels = _image_folder_in_memory(folder)
        return TensorImages(images, labels, transform)
    import torchvision
    try:
        ds = torchvision.datasets.CIFAR10(data_dir, train=(split == "train"), download=True)
    except Exception as e:  # offline, unwritable, corrupt: one line saying where we looked
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

    def __getitem__(self, i):
        x, y = self.dataset[i]
        return x, y, i


# ----------------------------------------------------------------------------------------------------------
# Statistics of CERTIFY (Cohen et al. 2019)
# ----------------------------------------------------------------------------------------------------------

def clopper_pearson_lower(nA, N, alpha):
    """One-sided (1 - alpha) Clopper-Pearson lower confidence bound on a binomial proportion.

    The alpha-quantile of Beta(nA, N - nA + 1); 0 when nA == 0 (the beta quantile is undefined there).
    Closed form at nA == N: alpha ** (1 / N). Works elementwise on numpy arrays.
    """
    nA, N = np.asarray(nA, dtype=float), np.asarray(N, dtype=float)
    with np.errstate(invalid="ignore"):
        bound = beta_dist.ppf(alpha, np.maximum(nA, 1), N - nA + 1)
    bound = np.where(nA > 0, bound, 0.0)
    return float(bound) if bound.ndim == 0 else bound


def clopper_pearson_upper(nA, N, alpha):
    """One-sided (1 - alpha) Clopper-Pearson upper bound: the (1 - alpha)-quantile of Beta(nA + 1, N - nA); 1 at nA == N."""
    nA, N = np.asarray(nA, dtype=float), np.asarray(N, dtype=float)
    with np.errstate(invalid="ignore"):
        bound = beta_dist.ppf(1 - alpha, nA + 1, np.maximum(N - nA, 1))
    bound = np.where(nA < N, bound, 1.0)
    return float(bound) if bound.ndim == 0 else bound


def certified_radius(pA_lower, sigma):
    """Certified l2 radius sigma * Phi^-1(pA_lower) of Cohen et al.'s Theorem 1 (negative below 1/2)."""
    return sigma * norm.ppf(pA_lower)


# ----------------------------------------------------------------------------------------------------------
# Noise and the Monte Carlo class counter (CERTIFY, PREDICT and training's pA estimates)
# ----------------------------------------------------------------------------------------------------------

def example_generator(seed, idx, device="cpu"):
    """A torch.Generator seeded by (seed, idx): example idx gets the same noise in any run, subset or shard."""
    state = np.random.SeedSequence([int(seed), int(idx)]).generate_state(2, dtype=np.uint32)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def gaussian_noise(shape, sigma, device, generator=None):
    """sigma * N(0, I) of the given shape, drawn on `device` (from `generator` if given)."""
    return sigma * torch.randn(shape, device=device, generator=generator)


@torch.no_grad()
def sample_counts(model, x, sigma, n, batch, num_classes, generator=None):
    """Count the base classifier's votes on n Gaussian-noised copies of each input.

    model: in eval mode, on x's device. x: (B, C, H, W) in [0, 1]. Each forward pass holds about `batch`
    noisy inputs (at least one noisy copy of every input). Noise is drawn on the device, votes are
    counted on the device. Returns an int64 tensor (B, num_classes) on x's device; counts sum to n per row.
    """
    B = x.shape[0]
    counts = torch.zeros(B, num_classes, dtype=torch.long, device=x.device)
    per_pass = max(1, batch // B)  # noisy copies of each input per forward pass
    remaining = n
    while remaining > 0:
        k = min(per_pass, remaining)
        noise = gaussian_noise((k, *x.shape), sigma, x.device, generator)      # (k, B, C, H, W)
        pred = model((x.unsqueeze(0) + noise).flatten(0, 1)).argmax(1)         # (k*B,)
        rows = torch.arange(B, device=x.device).repeat(k)                      # copy j of input b -> b
        counts.view(-1).index_add_(0, rows * num_classes + pred, torch.ones_like(pred))
        remaining -= k
    return counts


# ----------------------------------------------------------------------------------------------------------
# The adaptive attack on the noise sphere (Alg. 1, App. C.3; official behaviour in BASELINES.md 7.2)
# ----------------------------------------------------------------------------------------------------------

def sphere_pgd(model, x, y, delta, T, eps, norm_type="l2"):
    """Move each Gaussian noise along its sphere ||delta|| = const to make the base model err (Alg. 1).

    x: (B, C, H, W); y: (B,); delta: (m, B, C, H, W), the m noise draws. T PGD steps on the cross-entropy
    with step eps: l2 uses the normalised gradient, linf the sign scaled by 1/sqrt(d) (as the official code,
    so eps is comparable across norms). After each step every draw is rescaled to its original norm.
    Each draw keeps the first iterate the model misclassifies (a draw misclassified from the start comes back
    unchanged); draws never misclassified take the final iterate. T = 0 returns delta. Runs the model in eval
    mode with gradients off for the parameters and restores both, so weights and BatchNorm statistics stay.
    Returns a new tensor shaped like delta, detached.
    """
    if T == 0:
        return delta.detach().clone()
    m, B = delta.shape[:2]
    d = x[0].numel()
    was_training = model.training
    flags = [p.requires_grad for p in model.parameters()]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        xs, ys = x.unsqueeze(0).expand_as(delta).flatten(0, 1), y.repeat(m)    # block order (m*B, ...)
        r0 = delta.flatten(2).norm(dim=2).view(m * B, *[1] * (x.dim() - 1))    # (m*B, 1, 1, 1)
        cur = delta.detach().flatten(0, 1).clone()
        best = cur.clone()
        found = torch.zeros(m * B, dtype=torch.bool, device=x.device)
        for _ in range(T):
            cur.requires_grad_(True)
            logits = model(xs + cur)
            wrong = (logits.argmax(1) != ys) & ~found                          # first misclassification
            best[wrong] = cur.detach()[wrong]
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
        best[~found] = cur.detach()[~found]
        return best.view_as(delta)
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
        model.train(was_training)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: atomic save, tolerant load of ours and of the released ones (Cohen, SmoothAdv, ...)
# ----------------------------------------------------------------------------------------------------------

def save_checkpoint(state, path):
    """torch.save to a temporary file, then os.replace: a crash never leaves a torn checkpoint."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, device="cpu"):
    """Read a checkpoint dict ({'arch', 'state_dict', ...}); a missing or unreadable file is a UserError."""
    check(os.path.isfile(path), f"checkpoint {path!r} not found; pass --checkpoint with a trained model file")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise UserError(f"cannot read checkpoint {path!r} ({type(e).__name__}): not a torch checkpoint?") from None
    if isinstance(ckpt, dict) and "state_dict" not in ckpt and all(torch.is_tensor(v) for v in ckpt.values()):
        ckpt = {"state_dict": ckpt}  # a bare state_dict
    check(isinstance(ckpt, dict) and "state_dict" in ckpt,
          f"checkpoint {path!r} holds no 'state_dict'; expected {{'arch': ..., 'state_dict': ...}}")
    return ckpt


def strip_module_prefix(state_dict):
    """Drop every `module.` segment that DataParallel/DDP put into the keys (`1.module.conv1.weight`)."""
    return {".".join(p for p in k.split(".") if p != "module"): v for k, v in state_dict.items()}


def load_model(path, dataset=None, arch=None, device="cpu"):
    """Build the architecture named by the checkpoint (or `arch`) and load its weights with strict key matching.

    Returns (model in eval mode on device, checkpoint dict). Dataset defaults to the checkpoint's, else
    guessed from the architecture. A state_dict that does not fit is a UserError naming the first bad keys.
    """
    ckpt = load_checkpoint(path, device)
    arch = arch or ckpt.get("arch")
    check(arch is not None, f"checkpoint {path!r} names no architecture; pass --arch")
    dataset = dataset or ckpt.get("dataset") or {"resnet50": "imagenet", "digits_cnn": "digits",
                                                 "lenet": "digits"}.get(arch, "cifar10")
    model = get_architecture(arch, dataset)
    try:
        model.load_state_dict(strip_module_prefix(ckpt["state_dict"]), strict=True)
    except RuntimeError as e:
        first = str(e).split("\n\t")[1][:200] if "\n\t" in str(e) else str(e)[:200]
        raise UserError(f"checkpoint {path!r} does not fit architecture {arch!r} on {dataset}: {first}") from None
    return model.to(device).eval(), ckpt


# ----------------------------------------------------------------------------------------------------------
# Small utilities shared by the scripts
# ----------------------------------------------------------------------------------------------------------

def get_device(name=None):
    """torch.device from --device, default cuda when available."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    check(device.type != "cuda" or torch.cuda.is_available(), f"device {name!r} requested but CUDA is not available")
    return device


def seed_everything(seed):
    """Seed Python's, numpy's and torch's global generators."""
    import random
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def format_eta(done, total, start):
    """'12.3/s, ETA 0:04:10' for `done` of `total` items since time.time() == start."""
    elapsed = time.time() - start
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = datetime.timedelta(seconds=int((total - done) / rate)) if rate > 0 else "?"
    return f"{rate:.2f}/s, ETA {eta}"


def write_json(obj, path):
    """Write obj as pretty JSON (e.g. args.json beside a run's log)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)


# ----------------------------------------------------------------------------------------------------------
# The shared training loop (App. C.1): SGD, step schedule, m-chunk convention, noisy evaluation, logs
# ----------------------------------------------------------------------------------------------------------

def make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-4):
    """Plain SGD with momentum, as in every official RS training script."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def make_scheduler(optimizer, lr_step, gamma=0.1):
    """lr x gamma every lr_step epochs, stepped once at the end of each epoch (decays from epoch lr_step on)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=lr_step, gamma=gamma)


def split_chunks(batch, m):
    """Cut a loader batch into m consecutive chunks of floor(B/m) examples (BASELINES.md 0.1).

    Each chunk is replicated with m noise draws and gets its own optimizer step, so every step sees about
    B noisy inputs. Leftover examples of a batch not divisible by m are dropped, as in the official code.
    """
    b = batch[0].shape[0] // m
    if b == 0:
        return [batch]  # a batch smaller than m (tiny last batch): train on it whole
    return [tuple(t[i * b:(i + 1) * b] for t in batch) for i in range(m)]


def train_epoch(model, loader, optimizer, loss_fn, chunks, device, progress=None):
    """One training epoch: every loader batch is split into `chunks` chunks, one optimizer step each.

    loss_fn(model, x, y, idx) -> dict with 'loss' (scalar tensor to minimise), 'correct' (tensor: correct
    predictions among its noisy inputs) and 'total' (int: number of noisy inputs). Loss and accuracy are
    accumulated on the device (no per-step host synchronisation). Returns {'train_loss', 'train_acc'}.
    progress: optional callable(batches_done, batches_total) for a progress line.
    """
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    total, steps = 0, 0
    for i, batch in enumerate(loader):
        batch = tuple(t.to(device, non_blocking=True) for t in batch)
        for x, y, idx in split_chunks(batch, chunks):
            out = loss_fn(model, x, y, idx)
            optimizer.zero_grad(set_to_none=True)
            out["loss"].backward()
            optimizer.step()
            loss_sum += out["loss"].detach()
            correct += out["correct"]
            total += out["total"]
            steps += 1
        if progress is not None:
            progress(i + 1, len(loader))
    return {"train_loss": (loss_sum / max(steps, 1)).item(), "train_acc": (correct / max(total, 1)).item()}


def gaussian_loss(model, x, y, sigma, m):
    """Gaussian data augmentation (Cohen et al.): mean cross-entropy over m noisy copies, block order.

    x: (b, C, H, W), y: (b,). Returns the loss_fn dict of train_epoch.
    """
    noisy = (x.unsqueeze(0) + sigma * torch.randn(m, *x.shape, device=x.device)).flatten(0, 1)  # (m*b, ...)
    logits = model(noisy)
    targets = y.repeat(m)
    loss = F.cross_entropy(logits, targets)
    return {"loss": loss, "correct": (logits.argmax(1) == targets).sum(), "total": len(targets)}


@torch.no_grad()
def evaluate_noisy(model, loader, sigma, device):
    """Loss and accuracy of the base classifier on one Gaussian-noised copy of each test input."""
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    total = 0
    for batch in loader:
        x, y = batch[0].to(device), batch[1].to(device)
        logits = model(x + sigma * torch.randn_like(x))
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(1) == y).sum()
        total += len(y)
    return {"test_loss": (loss_sum / total).item(), "test_acc_noisy": (correct / total).item()}


class TSVLog:
    """Append rows to a TSV file with a fixed header, each row flushed at once (a killed run keeps its rows)."""

    def __init__(self, path, columns, append=False):
        self.columns = list(columns)
        exists = append and os.path.isfile(path) and os.path.getsize(path) > 0
        self.file = open(path, "a" if exists else "w")
        if not exists:
            print("\t".join(self.columns), file=self.file, flush=True)

    def row(self, **values):
        cells = [values.get(c, "") for c in self.columns]
        print("\t".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in cells), file=self.file, flush=True)

    def close(self):
        self.file.close()


def make_outdir(outdir):
    """Create the run folder (or raise a UserError saying it is not writable); returns it."""
    try:
        os.makedirs(outdir, exist_ok=True)
        probe = os.path.join(outdir, ".write_test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write to output folder {outdir!r} ({e.strerror}); pass a writable --outdir") from None
    return outdir
