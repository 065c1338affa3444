"""The language-model example: CharGPT (causal, tied head), TextDataModule (corpus, split, data.path errors), and a
short fit that learns more than the characters' frequencies."""

from __future__ import annotations

import math
import os

import pytest
import torch
from app_utils import run_forked

from lightning_sync.errors import ConfigError
from lightning_sync.examples.data import TextDataModule, default_corpus, read_text, split_text
from lightning_sync.examples.models import CharGPT, build_char_lm

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def corpus_data() -> TextDataModule:
    return TextDataModule()


@pytest.mark.unit
def test_default_corpus_is_cpythons_reference_text(corpus_data):
    text = default_corpus()
    assert len(text) > 400_000 and "assert" in text
    assert corpus_data.num_chars == len(text)
    assert 60 < corpus_data.vocab_size < 200
    # the entropy of its character frequencies, computed here independently
    counts = torch.tensor([text.count(ch) for ch in corpus_data.vocab], dtype=torch.float64)
    probs = counts / counts.sum()
    expected = float(-(probs * probs.log()).sum())
    assert corpus_data.unigram_entropy == pytest.approx(expected, rel=1e-9)
    assert corpus_data.unigram_bits == pytest.approx(expected / math.log(2), rel=1e-9)


@pytest.mark.unit
def test_split_is_deterministic_disjoint_and_covers_the_text(corpus_data):
    text = default_corpus()
    first, second = split_text(text), split_text(text)
    assert first == second
    assert sum(len(p) for p in first.values()) == len(text)
    assert 0.04 < len(first["val"]) / len(text) < 0.06 and 0.04 < len(first["test"]) / len(text) < 0.06
    again = TextDataModule()
    for name in ("train", "val", "test"):
        assert torch.equal(again.tokens[name], corpus_data.tokens[name])
    assert corpus_data.decode(corpus_data.tokens["val"][:100].tolist()) == first["val"][:100]
    # a short text still gives every split some characters
    short = split_text("abcdefghij" * 50)
    assert all(short.values()) and sum(map(len, short.values())) == 500


@pytest.mark.unit
def test_windows_are_next_character_pairs(corpus_data):
    corpus_data.setup("fit")
    x, y = corpus_data.splits["train"][3]
    assert x.shape == y.shape == (corpus_data.block_size,)
    assert torch.equal(x[1:], y[:-1])
    assert len(corpus_data.splits["val"]) == corpus_data.val_windows


def _small_model(**kw) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(vocab_size=50, block_size=16, d_model=32, n_layer=2, n_head=4, **kw)


@pytest.mark.unit
def test_logits_before_a_position_do_not_depend_on_it():
    model = _small_model().eval()
    tokens = torch.randint(0, 50, (3, 16))
    changed = tokens.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 7) % 50
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (3, 16, 50)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6), "a later character changed an earlier prediction"
    assert not torch.allclose(a[:, t:], b[:, t:], atol=1e-4), "the changed character reached no later position"


@pytest.mark.unit
def test_head_is_tied_to_the_token_embedding():
    model = _small_model()
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names and "tok_emb.weight" in names  # one tensor, counted once
    assert model.pos_emb.weight.shape == (16, 32)  # learned positions
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.unit
def test_bad_sizes_name_the_field():
    with pytest.raises(ConfigError, match=r"model.n_head=3 .*model.d_model=32"):
        CharGPT(vocab_size=10, block_size=8, d_model=32, n_head=3)
    with pytest.raises(ConfigError, match=r"data.block_size=1 "):
        TextDataModule(block_size=1)


@pytest.mark.unit
def test_default_size_is_in_the_communication_bound_regime(corpus_data):
    model, _ = build_char_lm(seed=0)
    params = sum(p.numel() for p in model.parameters())
    # a few hundred thousand parameters: one fp32 all-reduce is 4 x params bytes
    assert 300_000 < params < 1_000_000, params


@pytest.mark.unit
def test_seed_sets_the_initial_weights():
    a, _ = build_char_lm(seed=1, d_model=32, n_layer=1)
    b, _ = build_char_lm(seed=1, d_model=32, n_layer=1)
    c, _ = build_char_lm(seed=2, d_model=32, n_layer=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


@pytest.mark.unit
def test_user_text_file_and_folder(tmp_path):
    unseen = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, {i * i}.\n" for i in range(400))
    file = tmp_path / "book.txt"
    file.write_text(unseen)
    data = TextDataModule(path=str(file), block_size=32)
    assert data.num_chars == len(unseen) and set(data.vocab) == set(unseen)
    folder = tmp_path / "shelf"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(unseen[:10_000])
    (folder / "sub" / "b.txt").write_text(unseen[10_000:])
    (folder / "skip.md").write_text("ignored ~~~")
    shelf = TextDataModule(path=str(folder), block_size=32)
    assert "~" not in shelf.vocab and shelf.num_chars == len(unseen) + 2


@pytest.mark.unit
@pytest.mark.parametrize("case", ["missing", "folder_without_txt", "not_utf8", "empty", "too_short"])
def test_bad_path_is_one_line_naming_data_path(tmp_path, case):
    path = tmp_path / case
    if case == "folder_without_txt":
        path.mkdir()
        (path / "notes.md").write_text("x" * 5000)
    elif case == "not_utf8":
        path.write_bytes(b"\xff\xfe\x00bad" * 1000)
    elif case == "empty":
        path.write_text("")
    elif case == "too_short":
        path.write_text("only a few words")
    with pytest.raises(ConfigError) as info:
        read_text(path, min_chars=1000)
    message = str(info.value)
    assert message.startswith(f"data.path={str(path)!r} is not allowed") and "\n" not in message


def _env() -> dict[str, str]:
    """This process's environment without a launcher's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "MASTER_", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HYDRA_FULL_ERROR="0")
    return env


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_cli_bad_path_stops_before_any_rank(tmp_path):
    from lightning_sync.apps.train import main

    argv = ["lightning_sync.train", "experiment=char_lm", f"data.path={tmp_path}/nope.txt"]
    proc = run_forked(main, argv, tmp_path, _env(), timeout=180)  # no rank: a fork of this process will do
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: data.path=") and "no such file" in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Initializing distributed" not in proc.stdout + proc.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_cli_trains_two_ranks_on_a_text_it_has_never_seen(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "story.txt").write_text(
        "".join(f"Day {i}: the ship sailed {i % 7} leagues north, and the crew sang.\n" for i in range(600))
    )
    from lightning_sync.apps.train import main

    argv = [
        "lightning_sync.train", "experiment=char_lm", "strategy.start_method=fork", f"data.path={tmp_path}/texts",
        "trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks=none", "hydra.run.dir=run",
    ]  # fmt: skip
    proc = run_forked(main, argv, tmp_path, _env(), timeout=280)  # its ranks forked, and it a fork of this process
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("summary:"))
    assert "steps=6" in line and "test/loss=" in line and "unigram baseline: loss=" in line, line


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_short_fit_beats_the_unigram_baseline(tmp_path):
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    model, data = build_char_lm(seed=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=150, limit_val_batches=2, val_check_interval=150,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    val = float(trainer.callback_metrics["val/loss"])
    assert float(trainer.callback_metrics["val/bpc"]) == pytest.approx(val / math.log(2), rel=1e-5)
    assert val < data.unigram_entropy - 0.4, (val, data.unigram_entropy)
