"""bench.allocator_bench's prompts, memory reading and arithmetic (the servers' side runs in `make bench-allocator`)."""

import argparse
import subprocess
import sys

from bench import allocator_bench


def test_the_prompts_have_the_lengths_asked_from_different_places():
    texts = allocator_bench.prompts(2, max_words=400)
    assert [len(text.split()) for text in texts] == [min(n, 400) for n in allocator_bench.WORDS * 2]
    assert len(set(texts)) == len(texts)


def test_the_report_compares_the_mean_walls_and_counts_equal_texts():
    def done(wall, ttft, texts):
        return {"wall": wall, "ttft": ttft, "tokens": 96, "texts": texts}

    results = {"glibc": [done(13.0, 0.5, ["a", "b"]), done(11.0, 0.7, ["a", "b"])],
               "tcmalloc": [done(10.0, 0.3, ["a", "b"]), done(10.0, 0.3, ["a", "x"])]}
    rss = {"glibc": {"loaded": {"target_model": 900, "draft_model": 500}},
           "tcmalloc": {"loaded": {"target_model": 920, "draft_model": 510}}}
    args = argparse.Namespace(pair="default", max_words=1200, concurrency=4, max_tokens=48, passes=2)
    text = allocator_bench.report(results, rss, {"glibc": "--allocator glibc", "tcmalloc": "--allocator tcmalloc"},
                                  args, 2)
    row = next(line for line in text.splitlines() if line.startswith("| glibc  "))
    assert [cell.strip() for cell in row.strip("|").split("|")] == ["glibc", "13.0 / 11.0", "12.0", "600", "8.0"]
    assert "**1.20x**" in text and "texts equal: 3/4" in text
    row = next(line for line in text.splitlines() if line.startswith("| tcmalloc") and "loaded" in line)
    assert [cell.strip() for cell in row.strip("|").split("|")] == ["tcmalloc", "loaded", "510", "920", "1430"]


def test_the_stubs_memory_is_read_per_model_of_one_run_directory(tmp_path):
    """A process that ps shows as a stub of this run directory (argv[0] the stub's name, argv[1] the model's
    model.py, as Triton starts them) is counted under its model; nothing else is."""
    model_py = tmp_path / "model_repository" / "target_model" / "1" / "model.py"
    model_py.parent.mkdir(parents=True)
    model_py.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    assert allocator_bench.stub_rss_mb(tmp_path) == {}
    stub = subprocess.Popen(["bash", "-c", f'exec -a triton_python_backend_stub "{sys.executable}" "{model_py}"'],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert stub.stdout.readline() == "up\n"
        found = allocator_bench.stub_rss_mb(tmp_path)
        assert list(found) == ["target_model"] and 1 <= found["target_model"] < 1024, found
        assert allocator_bench.stub_rss_mb(tmp_path / "other") == {}
    finally:
        stub.kill()
        stub.wait()


def test_each_pass_has_prompts_of_its_own():
    first, second = allocator_bench.prompts(1, offset=0), allocator_bench.prompts(1, offset=1)
    assert not set(first) & set(second)
    assert [len(t.split()) for t in first] == [len(t.split()) for t in second]
