"""tinker-cookbook's supervised.train on its packaged example conversations, against a TRIO.

Run by test_cookbook.py as ``python sl_run.py LOG_PATH BASE_URL``: the recipe's own training
loop, unmodified, configured as its docs show (renderer ``role_colon``, which fits any
tokenizer), with a held-out split so its evaluator runs, and periodic saves.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def config(log_path: str, base_url: str) -> train.Config:
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=MODEL, renderer_name="role_colon", max_length=256, batch_size=8,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    builder = FromConversationFileBuilder(common_config=common, file_path=str(data), test_size=8)
    return train.Config(
        log_path=log_path, model_name=MODEL, recipe_name="trio_sl_test", renderer_name="role_colon",
        dataset_builder=builder, learning_rate=5e-4, lr_schedule="constant", lora_rank=8, base_url=base_url,
        max_steps=6, eval_every=3, save_every=3, infrequent_eval_every=0,
    )


if __name__ == "__main__":
    asyncio.run(train.main(config(sys.argv[1], sys.argv[2])))
