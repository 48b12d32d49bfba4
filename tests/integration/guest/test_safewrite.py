"""The safe writer against real kills, real bind mounts and real symlinks.

The crash test runs a child that rewrites one file in a loop between two
contents and SIGKILLs it at random moments; afterwards the file must hold one
of the two contents. The in-place path runs the child in its own mount
namespace with the file bind-mounted, so ``rename`` really fails with EBUSY
and the writer really takes its in-place branch.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from guest_agent.files.safewrite import PAD_BYTE, FileWriteError, is_mount_point, write_file

REPO = Path(__file__).parents[3]
SHORT = b"".join(b"10.0.0.%d\timex-93a7a316-%d\n" % (i, i) for i in range(6))
LONG = b"# long\n" + b"".join(b"10.1.0.%d\thost-%d.example\n" % (i, i) for i in range(40))
KILLS = 200
#: the tests that bind-mount run in a private mount namespace of their own
needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None,
                                   reason="util-linux unshare is not installed")

CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from guest_agent.files.safewrite import write_file
    path, contents = sys.argv[1], [bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4])]
    write_file(path, contents[0])
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    i = 1
    while True:
        write_file(path, contents[i & 1])
        i += 1
    """
)


def _kill_loop(argv_prefix: list[str], target: Path, observe: Path) -> list[bytes]:
    rng = random.Random(1234)
    seen = []
    for _ in range(KILLS):
        child = subprocess.Popen(
            [
                *argv_prefix,
                sys.executable,
                "-S",
                "-c",
                CHILD,
                str(target),
                str(REPO),
                SHORT.hex(),
                LONG.hex(),
            ],
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"ready\n"
            # A random moment inside the write loop (each pass takes ~0.1-1 ms).
            deadline = rng.uniform(0, 0.01)
            if deadline:
                subprocess.run(["sleep", f"{deadline:.4f}"], check=True)
        finally:
            child.kill()
            child.wait()
            assert child.stdout is not None
            child.stdout.close()
        seen.append(observe.read_bytes())
    return seen


def test_sigkill_during_rename_writes_leaves_one_of_two_contents(tmp_path: Path) -> None:
    target = tmp_path / "hosts"
    target.write_bytes(SHORT)
    seen = _kill_loop([], target, target)
    assert all(s in (SHORT, LONG) for s in seen), {s[:40] for s in seen if s not in (SHORT, LONG)}
    assert {SHORT, LONG} <= set(seen)  # the kills really landed at different moments
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "hosts"]
    assert all(n.startswith(".hosts.") and n.endswith(".imex-tmp") for n in leftovers)


@pytest.mark.root
@needs_unshare
def test_sigkill_during_in_place_writes_never_tears(tmp_path: Path) -> None:
    """Bind-mounted target: rename gets EBUSY, the writer writes in place.

    Allowed states: old, new, or (only between the padded pwrite and the
    ftruncate of a shrinking write) the new content followed by blank lines,
    which any hosts parser reads as the new content. Never a mix.
    """
    source = tmp_path / "source"
    source.write_bytes(SHORT)
    mount_dir = tmp_path / "etc"
    mount_dir.mkdir()
    target = mount_dir / "hosts"
    target.write_bytes(b"")
    prefix = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount --bind "{source}" "{target}" && exec "$0" "$@"',
    ]
    seen = _kill_loop(prefix, target, source)
    padded = {s for s in seen if s not in (SHORT, LONG)}
    for s in padded:
        assert s.startswith(SHORT) and set(s[len(SHORT) :]) == set(PAD_BYTE), s[:80]
    assert {SHORT, LONG} <= set(seen)
    assert not list(mount_dir.glob(".hosts.*"))  # rename path was tried and cleaned up


@pytest.mark.root
@needs_unshare
def test_a_mount_made_after_the_lookup_still_gets_its_write(tmp_path: Path) -> None:
    """The writer remembers a target that was not a mount point; one bind-mounted over
    it later makes the rename fail with EBUSY, and that write goes in place (into the
    mounted file, not beside it), as do the next ones. In a private mount namespace, so
    the mount dies with the child."""
    source, target = tmp_path / "source", tmp_path / "hosts"
    source.write_bytes(SHORT)
    script = textwrap.dedent(f"""
        import subprocess, sys
        sys.path.insert(0, {str(REPO)!r})
        from guest_agent.files import safewrite
        target = {str(target)!r}
        safewrite.write_file(target, b"new\\n")  # created: nothing to look up
        safewrite.write_file(target, b"before\\n")
        assert target in safewrite._NOT_MOUNTED
        subprocess.run(["mount", "--bind", {str(source)!r}, target], check=True)
        safewrite.write_file(target, bytes.fromhex({LONG.hex()!r}))
        assert target not in safewrite._NOT_MOUNTED
        safewrite.write_file(target, bytes.fromhex({SHORT.hex()!r}) + b"# again\\n")
        print("ok")
        """)
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-S", "-c", script],
        capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["ok"], out.stderr
    assert source.read_bytes() == SHORT + b"# again\n"  # both writes went into the mount
    assert target.read_bytes() == b"before\n"  # the file under it, as the first write left it
    assert not list(tmp_path.glob(".hosts.*"))


@pytest.mark.root
def test_bind_mounted_etc_hosts_inside_network_namespace(tmp_path: Path) -> None:
    """`ip netns exec` bind-mounts /etc/netns/NAME/hosts over /etc/hosts (FACTS.md)."""
    ns = f"imexsw{os.getpid()}"
    netns_etc = Path("/etc/netns") / ns
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        netns_etc.mkdir(parents=True)
        (netns_etc / "hosts").write_bytes(SHORT)
        script = (
            f"import sys; sys.path.insert(0, {str(REPO)!r});"
            "from guest_agent.files.safewrite import write_file;"
            f"print(write_file('/etc/hosts', bytes.fromhex({LONG.hex()!r})));"
            f"print(write_file('/etc/hosts', bytes.fromhex({LONG.hex()!r})));"
            f"print(write_file('/etc/hosts', bytes.fromhex({SHORT.hex()!r})))"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-S", "-c", script],
            check=True,
            capture_output=True,
            text=True,
        )
        assert out.stdout.split() == ["True", "False", "True"]
        assert (netns_etc / "hosts").read_bytes() == SHORT
        assert Path("/etc/hosts").read_bytes() != SHORT
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)
        shutil.rmtree(netns_etc, ignore_errors=True)


def test_unchanged_content_is_not_written(tmp_path: Path) -> None:
    target = tmp_path / "nodes_config.cfg"
    assert write_file(target, SHORT) is True
    inode = target.stat().st_ino
    os.utime(target, (1, 1))
    assert write_file(target, SHORT) is False
    assert target.stat().st_mtime == 1 and target.stat().st_ino == inode


def test_mode_and_owner_are_kept_and_new_files_get_0644(tmp_path: Path) -> None:
    target = tmp_path / "hosts"
    target.write_bytes(b"old\n")
    target.chmod(0o640)
    if os.geteuid() == 0:
        os.chown(target, 1234, 5678)
    assert write_file(target, LONG)
    st = target.stat()
    assert (st.st_mode & 0o7777) == 0o640
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (1234, 5678)
    fresh = tmp_path / "fresh"
    write_file(fresh, b"x\n")
    assert fresh.stat().st_mode & 0o777 == 0o644


def test_symlink_target_written_and_link_kept(tmp_path: Path) -> None:
    real = tmp_path / "real-hosts"
    real.write_bytes(SHORT)
    link = tmp_path / "hosts"
    link.symlink_to(real)
    assert write_file(link, LONG)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == LONG


def test_unwritable_location_raises_error_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "hosts"
    with pytest.raises(FileWriteError, match="no-such-dir/hosts"):
        write_file(missing, SHORT)


def test_stale_temp_files_are_removed_by_the_next_write(tmp_path: Path) -> None:
    target = tmp_path / "hosts"
    target.write_bytes(SHORT)
    stale, fresh = tmp_path / ".hosts.abc123.imex-tmp", tmp_path / ".hosts.def456.imex-tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (1, 1))
    write_file(target, LONG)
    assert not stale.exists() and fresh.exists()


def test_is_mount_point() -> None:
    assert is_mount_point("/proc")
    assert not is_mount_point(str(REPO / "pyproject.toml"))
