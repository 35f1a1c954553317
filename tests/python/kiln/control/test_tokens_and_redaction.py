"""Tokens have one spelling and a bounded life; redaction hides credentials under names and in
values it has no list entry for."""

from __future__ import annotations

import math
import time

import pytest

from kiln.control.__main__ import main as control_main
from kiln.control.redact import REDACTED, redact, redact_environment
from kiln.control.tokens import (
    HIDDEN_TOKEN,
    hide_tokens,
    mint_token,
    token_expiring_in,
    verify_token,
)
from kiln_contract.vocabulary import MAX_TOKEN_TTL_MINUTES

KEY = b"k" * 32
BASE64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def test_a_token_has_exactly_one_accepted_spelling() -> None:
    token = mint_token(KEY, int(time.time()) + 600)
    assert verify_token(KEY, token)
    last = BASE64URL.index(token[-1])
    # The last character holds 2 bits of the MAC and 4 unused bits: every other value of the
    # unused bits decodes to the same bytes, and each such spelling is refused.
    variants = [token[:-1] + BASE64URL[(last & 0b110000) | low] for low in range(16)]
    accepted = [variant for variant in variants if verify_token(KEY, variant)]
    assert accepted == [token]


def test_hide_tokens_hides_the_token_of_every_capability_url_and_nothing_else() -> None:
    token, other = mint_token(KEY, 2_000_000_000), mint_token(KEY, 2_000_000_001)
    line = f"training control: http://127.0.0.1:41234/c/{token}/ and [::1]:80/c/{other}"
    assert hide_tokens(line) == (
        f"training control: http://127.0.0.1:41234/c/{HIDDEN_TOKEN}/ and [::1]:80/c/{HIDDEN_TOKEN}"
    )
    for harmless in ("/c/short/", f"/c/{token}x/", f"/d/{token}/", "step 3 loss 2.5"):
        assert hide_tokens(harmless) == harmless


@pytest.mark.parametrize("ttl", [math.nan, math.inf, -1.0, 0.0, MAX_TOKEN_TTL_MINUTES + 1])
def test_token_lifetimes_are_finite_positive_and_capped(ttl: float) -> None:
    with pytest.raises(ValueError, match="token_ttl_minutes must be > 0 and <= 10080"):
        token_expiring_in(KEY, ttl)


@pytest.mark.parametrize("ttl", ["nan", "inf", "1e9", "0"])
def test_the_mint_cli_refuses_a_ttl_that_is_not_finite_or_too_long(
    ttl: str, tmp_path, capsys
) -> None:
    with pytest.raises(SystemExit) as exit:
        control_main(["mint", str(tmp_path), "--ttl-minutes", ttl])
    assert exit.value.code == 2
    assert "--ttl-minutes: expected a number > 0 and <= 10080" in capsys.readouterr().err


# Credentials under names that are in no list of the redactor's (its words are generic).
UNSEEN_SECRET_NAMES = {
    "PGPASS": "correct-horse",
    "MYSQL_PWD": "battery-staple",
    "GITLAB_PAT": "glpat-abc",
    "ACME_BEARER": "opaque",
    "ORCHESTRATOR_SESSION": "s3ss",
    "BillingWebhook": "https://hooks.example/T0/B1",
    "vaultCreds": "root:root",
    "SENTRY_DSN": "https://public@sentry.example/1",
    "MyServiceAuthToken": "abc",
    "db_Passphrase": "words",
    # Secret parts inside run-together words, in any position and case.
    "LDAP_BINDPW": "bind-me-in",
    "GIT_SIGNINGKEY": "0xDEADBEEF",
    "ldapBindCredential": "cn-admin",
    "XAUTHSTRING": "magic",
    "my_gpgkeyring_pass_file_contents": "hidden",
}
# Credentials in the values of harmless-looking names.
UNSEEN_SECRET_VALUES = {
    "MIRROR": "https://x-access:ya29RandomBits@git.example/repo.git",
    "UPSTREAM": "https://ghs0123456789abcdef@github.example/org/repo",
    "CALLBACK": "https://api.example/v1/hook?access_token=abc123&x=1",
    "LEGACY_CONN": "host=db port=5432 user=app password=letmein",
    "BLOB": "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZmdoaWprbG1u",
    "ROTATED": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    # Shapes alone: a generated value, a webhook whose path is the secret, a signed query, a
    # PGP key block, a random value inside a command line.
    "BUILD_LABEL": "q8ZxLm2NvKp4RtYw7sHj1Fd",
    "NOTIFY": "https://hooks.chat.example/services/T0A1B2C3D/B0A1B2C3D/q8ZxLm2NvKp4RtYw7sHj1Fd3",
    "DOWNLOAD": "https://cdn.example/file.tar?expires=1700000000&sig=Zx81kLmQ0pWnR7tYbV3cA9",
    "GPG_MATERIAL": "-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQOYBF...",
    "LAUNCH_ARGS": "--mode fast --label 7hG2kQ9zLmP4xR8wT1vN",
    # A webhook whose secret path reads as words, under a name with no secret word in it.
    "DEPLOY_ALERTS": "https://hooks.example/incoming/correct-horse-battery-staple",
}
# What stays readable: paths, words, numbers, and the shell's own folder variables.
HARMLESS = {
    "PWD": "/home/me/kiln",
    "OLDPWD": "/home/me",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/home/me",
    "LANG": "en_US.UTF-8",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    "KILN_OUTPUT": "/store/checkpoints/tiny_llama_experiment_number_one/2026.11.29",
    "COLUMNS": "120",
    # Identifiers made of words and numbers, however long, stay readable.
    "TOKENIZERS_PARALLELISM": "false",
    "TOKENIZER_CLASS": "GPT2TokenizerFast",
    "MODEL_CLASS": "HuggingFaceLlamaForCausalLM",
    "MACHTYPE": "x86_64-pc-linux-gnu",
    "CUDA_BUILD": "cuda13-linux-x86_64",
    "HF_MODEL": "meta-llama/Llama-3.1-8B-Instruct",
    "BEST": "checkpoints/dclm_1b_1x/step-40000",
    # Endpoints without a path, and buckets.
    "HF_ENDPOINT": "http://127.0.0.1:8080",
    "HUB": "https://hub.example/",
    "KILN_PREFIX": "s3://research-bucket/kiln/artifacts",
}


def test_environment_redaction_hides_credentials_it_has_no_list_entry_for() -> None:
    shown = redact_environment({**UNSEEN_SECRET_NAMES, **UNSEEN_SECRET_VALUES, **HARMLESS})
    hidden = {name for name, value in shown.items() if value == REDACTED}
    assert hidden == set(UNSEEN_SECRET_NAMES) | set(UNSEEN_SECRET_VALUES)
    assert {name: shown[name] for name in HARMLESS} == HARMLESS


def test_random_looking_values_of_sixteen_characters_are_hidden_under_any_name() -> None:
    """The value rule alone (the name is harmless), over values of each generator's alphabet:
    a fixed sample, so that the test cannot flake. Each must be hidden."""
    generated = [
        "a8Kf93LmQz0pR7tX",  # base62
        "Rz4_kP9-wQ2mLx7v",  # base64url, as secrets.token_urlsafe makes them
        "7f3a9c0e51b2d846",  # hex
        "X9K2M7Q4Z8W1R5T3",  # upper case and digits
        "k2j9x7q4m8w1r5t3z6",  # lower case and digits
    ]
    shown = redact_environment({f"VALUE_{i}": value for i, value in enumerate(generated)})
    assert set(shown.values()) == {REDACTED}


def test_config_redaction_follows_the_same_policy() -> None:
    config = {"store": {"webhookUrl": "https://h.example/x", "mirror": UNSEEN_SECRET_VALUES["MIRROR"]},
              "data": {"text_key": "text", "num_shards": 4}}  # fmt: skip
    assert redact(config) == {
        "store": {"webhookUrl": REDACTED, "mirror": REDACTED},
        "data": {"text_key": "text", "num_shards": 4},
    }
