"""Small shared test helpers: a briefly trained digits model, so that certificates differ between examples."""
import torch
import torch.nn.functional as F

import common
import machinery


def train_digits_model(arch="lenet", sigma=0.25, steps=100, seed=0):
    """arch trained for `steps` SGD steps (64 digits each) under Gaussian noise sigma; returns it in eval mode."""
    torch.manual_seed(seed)
    model = common.get_architecture(arch, "digits")
    train = common.get_dataset("digits", "train")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        i = torch.randint(0, len(train), (64,))
        x, y = train.images[i], train.labels[i]
        loss = F.cross_entropy(model(x + sigma * torch.randn_like(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def digits_checkpoint(path, arch="lenet", sigma=0.25, steps=100, seed=0):
    """A checkpoint file of train_digits_model at path (as our training scripts write them); returns path."""
    model = train_digits_model(arch, sigma, steps, seed)
    machinery.save_checkpoint({"arch": arch, "dataset": "digits", "sigma": sigma, "state_dict": model.state_dict()},
                              str(path))
    return str(path)


def run_main(main, argv):
    """main(argv) as its command line runs it (through machinery.run), in this process; returns the exit code."""
    try:
        machinery.run(lambda: main([str(a) for a in argv]))
    except SystemExit as e:
        return e.code
    return 0
