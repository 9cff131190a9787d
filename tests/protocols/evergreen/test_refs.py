"""The ref sandbox: allowed roots only, no `..` traversal, no symlink escapes, streamed reads."""

from __future__ import annotations

import os

import grpc
import pytest

from tokenwire.protocols.evergreen.errors import SessionAbort
from tokenwire.protocols.evergreen.refs import RefSandbox


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "clip.mp4").write_bytes(b"v" * 5000)
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    os.symlink(secret, root / "escape.txt")  # points outside the root
    os.symlink(tmp_path, root / "up")  # a directory link to the parent
    os.symlink(root / "sub" / "clip.mp4", root / "inside.mp4")  # stays inside: allowed
    return root, secret


def denied(sandbox: RefSandbox, uri: str) -> str:
    with pytest.raises(SessionAbort) as info:
        sandbox.resolve(uri)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    return info.value.message


def test_allowed_forms(tree):
    root, _ = tree
    sandbox = RefSandbox([root])
    assert sandbox.resolve(f"file://{root}/sub/clip.mp4") == root / "sub" / "clip.mp4"
    assert sandbox.resolve("file://sub/clip.mp4") == root / "sub" / "clip.mp4"  # the seed's relative form
    assert sandbox.resolve("file://inside.mp4") == root / "sub" / "clip.mp4"
    assert sandbox.summarize("file://sub/clip.mp4").size == 5000


def test_traversal_is_denied(tree):
    root, secret = tree
    sandbox = RefSandbox([root])
    assert "outside the allowed ref roots" in denied(sandbox, f"file://{root}/../secret.txt")
    assert "outside" in denied(sandbox, "file://sub/../../secret.txt")
    assert "outside" in denied(sandbox, f"file://{root}/sub/%2e%2e/%2e%2e/secret.txt")
    assert "outside" in denied(sandbox, f"file://{secret}")


def test_symlink_escapes_are_denied(tree):
    root, _ = tree
    sandbox = RefSandbox([root])
    assert "outside" in denied(sandbox, "file://escape.txt")
    assert "outside" in denied(sandbox, "file://up/secret.txt")
    assert "outside" in denied(sandbox, f"file://{root}/up/root/../secret.txt")


def test_other_schemes_and_no_roots(tree):
    root, _ = tree
    assert "scheme 'http'" in denied(RefSandbox([root]), "http://example.com/x.mp4")
    assert "scheme '(none)'" in denied(RefSandbox([root]), "/etc/passwd")
    assert "no --allow-ref-root" in denied(RefSandbox([]), "file://sub/clip.mp4")


def test_missing_file_is_not_found(tree):
    root, _ = tree
    with pytest.raises(SessionAbort) as info:
        RefSandbox([root]).resolve("file://sub/none.mp4")
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_reads_are_streamed_in_blocks(tree):
    root, _ = tree
    blocks = list(RefSandbox([root]).open_blocks("file://sub/clip.mp4", block=1024))
    assert [len(b) for b in blocks] == [1024] * 4 + [904]
