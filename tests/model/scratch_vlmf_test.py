import os, pytest
import test_vlm_families as T
from kits.vlm import make_vlm_data
from kits.vlm_more import MORE_SAVERS
FAM = os.environ["FAM"]
pytestmark = pytest.mark.usefixtures("own_signal_handlers")

@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    return {FAM: make_vlm_data(tmp_path_factory.mktemp(FAM), MORE_SAVERS[FAM](tmp_path_factory.mktemp(FAM) / "model"),
                               max_length=int(os.environ.get("MAXLEN", 96)))}

def test_one(vlms, tmp_path):
    T.test_family_trains_merges_and_verifies(FAM, vlms, tmp_path)

def test_batch(vlms):
    import pickle
    from pipeline.data.tokenize import load_chat
    from pipeline.data.processors import build_processor
    data = vlms[FAM]
    _, images = load_chat(data["model"])
    images = pickle.loads(pickle.dumps(images))
    processor = build_processor(data["model"], False)
    theirs, ours = T._processor_batch(data, images, processor)
    print(images.tokenizer.convert_ids_to_tokens(theirs["input_ids"][0]))
    print(images.tokenizer.convert_ids_to_tokens(ours["input_ids"][0]))
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
import torch
