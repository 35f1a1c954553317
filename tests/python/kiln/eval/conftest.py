from __future__ import annotations

import pytest
from kiln_testing.lm_eval_tasks import LocalTasks, make_tokenizer, write_local_tasks
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def local_tasks(tmp_path_factory: pytest.TempPathFactory) -> LocalTasks:
    return write_local_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))
