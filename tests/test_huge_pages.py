"""The loaded weights on 2 MB pages (runtime.huge_pages): the kernel's own accounting (/proc/self/smaps)
says what got collapsed and that what was excluded stays as it was; an engine collapses a large model's
weights, never its KV cache, and leaves a tiny model alone."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import platform
from pathlib import Path

import pytest
import torch

from pdserve.runtime import huge_pages
from tests.conftest import STORIES_GGUF

MB = 1 << 20

MAPS = """\
55d0c0a00000-55d0c0c00000 r--p 00000000 08:01 123  /usr/bin/python3.11
55d0c2000000-55d0c4000000 rw-p 00000000 00:00 0    [heap]
7f0000000000-7f0004000000 rw-p 00000000 00:00 0
7f0004000000-7f0008000000 ---p 00000000 00:00 0
7f0008000000-7f0008200000 rw-s 00000000 00:01 77   /dev/shm/segment
7f0008200000-7f0008400000 rw-p 00000000 08:01 456  /models/weights.gguf
7f0009000000-7f0009400000 rw-p 00000000 00:00 0
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0    [stack]
"""


def test_only_private_anonymous_read_write_mappings_are_listed(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    assert list(huge_pages.anonymous_mappings(maps)) == [
        (0x55d0c2000000, 0x55d0c4000000), (0x7f0000000000, 0x7f0004000000), (0x7f0009000000, 0x7f0009400000)]


SMAPS = """\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:      2048 kB
VmFlags: rd wr mr mw me ac hg
7f0000400000-7f0000401000 rw-p 00000000 00:00 0
Size:                  4 kB
Rss:                   4 kB
AnonHugePages:         0 kB
"""


def test_a_mapping_field_is_read_from_the_mapping_holding_the_address(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    assert huge_pages.mapping_field(0x7f0000100000, "AnonHugePages", smaps) == 2048 * 1024
    assert huge_pages.mapping_field(0x7f0000100000, "Rss", smaps) == 4096 * 1024
    assert huge_pages.mapping_field(0x7f0000400010, "AnonHugePages", smaps) == 0
    assert huge_pages.mapping_field(0x7f0000400010, "Rss", smaps) == 4096
    assert huge_pages.mapping_field(0x100, "Rss", smaps) == 0  # no mapping holds it


def test_the_thp_setting_is_read_from_its_brackets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never")):
        setting.write_text(text)
        assert huge_pages.thp_mode() == mode
    assert not huge_pages.available()  # "never": nothing to ask for
    setting.unlink()
    assert huge_pages.thp_mode() is None and not huge_pages.available()


def kernel_version() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def test_the_whole_huge_pages_of_the_mappings_not_excluded_are_collapsed() -> None:
    mappings = [(0x7f0000000000, 0x7f0000a00000), (0x7f0000b00000, 0x7f0001000000), (0x7f0001000000, 0x7f0001100000),
                (0x7f0002000000, 0x7f0002400000)]
    kv_cache = (0x7f0002100000, 0x7f0002200000)  # inside the last mapping
    assert huge_pages.loaded_ranges(mappings, exclude=[kv_cache]) == [
        (0x7f0000000000, 0x7f0000a00000),  # already aligned: all of it
        (0x7f0000c00000, 0x7f0001000000)]  # rounded inward; the 1 MB mapping holds no whole huge page


def test_a_written_mapping_is_collapsed_in_place() -> None:
    """On every host: the contents kept; what the kernel did is what its THP setting and version allow."""
    pages = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # weights' memory, as written
    weights = torch.frombuffer(pages, dtype=torch.float32)
    weights.fill_(1.5)
    ranges = huge_pages.loaded_ranges([huge_pages.span(weights)])
    size = sum(hi - lo for lo, hi in ranges)
    assert size >= 14 * MB
    if not huge_pages.available():  # THP off (or not Linux): nothing asked, nothing changed
        assert huge_pages.collapse_loaded() == huge_pages.Collapsed()
    elif kernel_version() < (6, 1):  # no MADV_COLLAPSE: the range is advised for khugepaged instead
        assert huge_pages.collapse(ranges) == huge_pages.Collapsed(advised=size)
    else:
        assert huge_pages.collapse(ranges) == huge_pages.Collapsed(collapsed=size)
        assert huge_pages.mapping_field(weights.data_ptr(), "AnonHugePages") >= 14 * MB  # the kernel's own account
    assert torch.equal(weights, torch.full_like(weights, 1.5))  # contents kept


def test_an_engine_collapses_a_large_models_weights_but_never_its_kv_cache(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from pdserve.runtime.config import CacheConfig, EngineConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_checkpoint

    calls: list[list[tuple[int, int]]] = []
    done = huge_pages.Collapsed(collapsed=6 * MB, advised=2 * MB, failed=4 * MB, errors=frozenset({errno.ENOMEM}))
    monkeypatch.setattr(huge_pages, "collapse_loaded",  # the real one is tested above, on a process of its own size
                        lambda exclude=(): calls.append(list(exclude)) or done)
    checkpoint = load_checkpoint(STORIES_GGUF)

    def engine(huge: bool) -> Engine:
        return Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=64), huge_pages=huge))

    engine(True)
    assert calls == []  # 260K parameters: its weights live in cache, the collapse's seconds would buy nothing
    monkeypatch.setattr(huge_pages, "MIN_PARAMETERS", 0)
    with caplog.at_level(logging.INFO, logger="pdserve.runtime.engine"):
        large = engine(True)
    assert calls == [[huge_pages.span(large.kv_cache)]]
    assert ("6 MB collapsed, 2 MB advised, 4 MB left on 4 KB pages (ENOMEM: Cannot allocate memory)"
            in caplog.text)  # what the kernel would not do, said
    engine(False)
    assert len(calls) == 1


def test_failed_ranges_errnos_are_named() -> None:
    assert huge_pages.describe_errors(()) == "none"
    assert huge_pages.describe_errors({errno.EAGAIN, errno.ENOMEM}) == (
        f"EAGAIN: {os.strerror(errno.EAGAIN)}, ENOMEM: {os.strerror(errno.ENOMEM)}")


def test_smollm2_is_worth_collapsing_and_stories260k_is_not() -> None:
    import dataclasses

    from pdserve.runtime.loader import load_checkpoint

    stories = load_checkpoint(STORIES_GGUF).config
    smollm2 = dataclasses.replace(stories, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                  num_heads=9, num_kv_heads=3, head_dim=64)
    assert not huge_pages.worth_it(stories) and huge_pages.worth_it(smollm2)


def test_workers_and_up_take_huge_pages_by_default() -> None:
    from pdserve.cli import build_parser
    from pdserve.commands.up import plan
    from pdserve.engine_args import engine_config_from_args

    def config(role: str, *flags: str):
        return engine_config_from_args(build_parser().parse_args([role, "--model", str(STORIES_GGUF), *flags]))

    assert config("decode").huge_pages and config("prefill").huge_pages and config("bench-engine").huge_pages
    assert not config("decode", "--huge-pages", "off").huge_pages
    workers, _ = plan(build_parser().parse_args(["up", "--huge-pages", "off", "--no-internal-token"]))
    for spec in (w for w in workers if w.name != "kvstore"):
        command = list(spec.command)
        assert command[command.index("--huge-pages") + 1] == "off", spec.name
