"""A generator-side process for the learner test: receives every announced version through
tidal-weight-sync into its own copy of the model and records the logprob of a probe completion."""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from tidal.core.channels import sub
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync import WeightReceiver, load_into
from tidal.weight_sync.errors import WeightSyncError


def main() -> None:
    endpoint, model_path, out, prompt, completion, until = sys.argv[1:7]
    prompt_ids, completion_ids = json.loads(prompt), json.loads(completion)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    announcements = sub(endpoint, topics=["weights"], linger=0)
    with WeightReceiver("zmq") as receiver, open(out, "a") as log:
        while receiver.version < int(until):
            try:
                _, ann = announcements.recv(timeout=120)
            except ChannelTimeout:
                break
            # as a rollout worker's WeightApplier does: the newest announcement only (a sender holds a few
            # versions; one that fell behind would ask for a version already dropped), and a version that
            # cannot be had is skipped, the old weights kept
            while True:
                try:
                    _, newer = announcements.recv(timeout=0)
                except ChannelTimeout:
                    break
                if isinstance(newer, WeightsAvailable) and (not isinstance(ann, WeightsAvailable) or newer.version > ann.version):
                    ann = newer
            if not isinstance(ann, WeightsAvailable) or ann.version <= receiver.version:
                continue
            try:
                receiver.receive(ann, load_into(model))
            except WeightSyncError as e:
                print(f"version {ann.version} skipped: {e}", flush=True)
                continue
            with torch.no_grad():
                ids = torch.tensor([prompt_ids + completion_ids])
                logp = torch.log_softmax(model(ids).logits[0, len(prompt_ids) - 1 : -1].float(), -1)
                value = logp.gather(1, torch.tensor(completion_ids)[:, None]).sum().item()
            log.write(json.dumps({"version": receiver.version, "logp": value}) + "\n")
            log.flush()


if __name__ == "__main__":
    main()
