"""The reference run's declared sources (experiments/datasets/BUILD), pinned: changing an id, a
revision, a file pattern, a URL or a digest means changing this test too (docs/datasets.md cites
where each comes from). And the `url_files(...)` source kind's checks at load."""

from __future__ import annotations

from pathlib import Path

import pytest
from kiln_reading import read_target
from pants.engine.addresses import Address, Addresses
from pants.engine.internals.scheduler import ExecutionError
from pants.testutil.rule_runner import RuleRunner

from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest

DATASETS = "experiments/datasets"
LLAMA3 = "meta-llama/Meta-Llama-3.1-8B"
PALOMA_DIRECTORIES = {
    "4chan": "4chan_meta_sep",
    "c4_100_domains": "c4_100_domains",
    "c4_en": "c4_en",
    "dolma-v1_5": "dolma-v1_5",
    "dolma_100_programing_languages": "dolma_100_programing_languages",
    "dolma_100_subreddits": "dolma_100_subreddits",
    "falcon-refinedweb": "falcon-refinedweb",
    "gab": "gab",
    "m2d2_s2orc_unsplit": "m2d2_s2orc_unsplit",
    "m2d2_wikipedia_unsplit": "m2d2_wikipedia_unsplit",
    "manosphere_meta_sep": "manosphere_meta_sep",
    "mc4": "mc4",
    "ptb": "ptb",
    "redpajama": "redpajama",
    "twitterAAE_HELM_fixed": "twitterAAE_HELM_fixed",
    "wikitext_103": "wikitext_103",
}
UNCHEATABLE_DATA = (
    "https://raw.githubusercontent.com/Jellyfish042/uncheatable_eval/"
    "a8e7fdc1274a65b7529f27e08b87b4fc6e7702b1/data/"
)
UNCHEATABLE_FILES = {
    "wikipedia_english": "sha256:03c03d473084d2324e069a2227c18e728c436ebdf2068379a7c71a2d4649b19c",
    "github_python": "sha256:34e5e846bcce20660f034b206a71c54e4a71a495f62a2ca310c7cae10b23d571",
    "github_cpp": "sha256:793871f32c7a65fc13408d6345618b0135a37b94c353f9e30eca8208aece8edf",
    "bbc_news": "sha256:6145b32e0a926b99b62bcbfd6daadc9f23749531a587b34810b1cf9aab3688a9",
    "arxiv_physics": "git-blob-sha1:c8ed9e1c67e44e76a21e873191b5d641588719eb",
    "arxiv_computer_science": "git-blob-sha1:0655116991229e5b9921497f0f44e489b4dfb9b1",
    "ao3_english": "git-blob-sha1:b7bf3851186f090400432c043f25aad7a576ec85",
}
TRAINING = {  # at the revisions of Marin's experiments/pretraining_datasets.py
    "dclm_baseline": ("mlfoundations/dclm-baseline-1.0", "a3b142c"),
    "starcoderdata": ("bigcode/starcoderdata", "9fc30b5"),
    "proofpile_2": ("EleutherAI/proof-pile-2", "901a927"),
}


def expected_sources() -> dict[str, dict]:
    def hub(dataset_id: str, split: str = "train", **more: object) -> dict:
        return {"kind": "hf", "id": dataset_id, "revision": None, "subset": None, "split": split, **more}

    expected = {name: hub(id_, revision=rev) for name, (id_, rev) in TRAINING.items()}
    for subset, directory in PALOMA_DIRECTORIES.items():
        expected[f"paloma_{subset}"] = hub(
            "allenai/paloma",
            "validation",
            revision="65cd6fc",
            data_files=[f"{directory}/val/val*.jsonl.gz"],
        )
    for category, digest in UNCHEATABLE_FILES.items():
        url = f"{UNCHEATABLE_DATA}{category}_20250101to20250115.json"
        expected[f"uncheatable_{category}"] = {
            "kind": "url_files",
            "files": {url: digest},
            "format": "auto",
        }
    return expected


def test_the_reference_datasets_are_declared_as_pinned(rule_runner: RuleRunner) -> None:
    rule_runner.write_files({f"{DATASETS}/BUILD": Path(DATASETS, "BUILD").read_text()})
    expected = expected_sources()
    addresses = [Address(DATASETS, target_name=name) for name in expected]
    graph = rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses(addresses))])
    declared = {}
    for address in addresses:
        identity = graph.get(address).identity
        assert identity["tokenizer"]["id"] == LLAMA3, address
        declared[address.target_name] = identity["source"]
    assert declared == expected


URL = "https://example.org/data/a.jsonl.gz"
SHA = "sha256:" + "ab" * 32


def url_cache(files: str, extra: str = "") -> str:
    return (
        f'tokenized_cache(name="c", source=url_files({files}), tokenizer="package:gpt2", '
        f'version="dev"{extra})'
    )


@pytest.mark.parametrize(
    "files, expected",
    [
        (f"{{'{URL}': 'ab' * 32}}", "url_files(): `files['https://example.org/data/a.jsonl.gz']`: expected 'sha256:'"),
        (f"{{'{URL}': 'sha256:' + 'AB' * 32}}", "64 lowercase hex digits"),
        (f"{{'ftp://example.org/a.json': '{SHA}'}}", "expected an https:// (or http://) file URL"),
        ("{}", "url_files(): `files`: expected a {url: digest} mapping of at least one file"),
    ],
)
def test_url_files_are_checked_at_load(rule_runner: RuleRunner, files: str, expected: str) -> None:
    rule_runner.write_files({"exp/BUILD": url_cache(files)})
    with pytest.raises(ExecutionError) as error:
        read_target(rule_runner, Address("exp", target_name="c"))
    assert expected in str(error.value)
    assert "exp/BUILD" in str(error.value)


def test_url_files_enter_the_fingerprint_and_refuse_hub_fields(rule_runner: RuleRunner) -> None:
    address = Address("exp", target_name="c")
    fingerprints = set()
    for digest in (SHA, "sha256:" + "cd" * 32, "git-blob-sha1:" + "ef" * 20):
        rule_runner.write_files({"exp/BUILD": url_cache(f"{{'{URL}': '{digest}'}}")})
        graph = rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([address]))])
        assert graph.get(address).identity["source"]["files"] == {URL: digest}
        fingerprints.add(graph.get(address).fingerprint)
    assert len(fingerprints) == 3
    rule_runner.write_files({"exp/BUILD": url_cache(f"{{'{URL}': '{SHA}'}}", ", revision='main'")})
    with pytest.raises(ExecutionError) as error:
        read_target(rule_runner, address)
    assert "reads no Hugging Face dataset: remove `revision`" in str(error.value)
