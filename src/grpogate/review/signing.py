"""Sign a finished run directory, and verify it, with OpenSSF model-signing and a local key pair.

The audit proves a run is consistent with itself and (with --replay) with its artifacts; a
signature proves who delivered it. `grpogate sign RUN --key PRIVATE.pem` signs every file of
the run directory (model-signing's manifest of per-file hashes, signed with an elliptic-curve
private key, written as a Sigstore bundle to RUN/run.sig); `grpogate decide RUN --verify-key
PUBLIC.pem` verifies it. Local keys only: no Sigstore identity, no network. The library is an
optional extra (`pip install grpogate[signing]`); without it these two options say so.

Sign after everything that writes into the run (the report included): any file added or
changed afterwards fails the verification, which is the point.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files import LOCK_FILE, RunDirLock, file_mode, write_in_run_dir

SIGNATURE_FILE = "run.sig"


def _library():
    try:
        from model_signing import hashing, signing, verifying
    except ImportError as error:
        raise InputError(f"signing needs the model-signing library ({error}); install it with "
                         "`pip install 'grpogate[signing]'`") from None
    return hashing, signing, verifying


def _hashing_config(hashing, run_dir: Path):
    # The signature cannot cover itself; the lock file is transient (present only while a
    # writer holds the run, which verification refuses). Nothing else is left out: the
    # library's default also skips .git/, .github/, .gitattributes and .gitignore, and a file
    # added under one of those names after signing would still verify.
    return hashing.Config().set_ignored_paths(
        paths=[run_dir / SIGNATURE_FILE, run_dir / LOCK_FILE], ignore_git_paths=False)


def _elliptic_key(path: str | Path, private: bool) -> None:
    """Refuse (InputError) a key file that is not a PEM elliptic-curve key of the kind needed:
    the library's own loader ends in an AttributeError on an RSA or Ed25519 key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    kind = "private" if private else "public"
    try:
        data = Path(path).read_bytes()
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError, OSError) as error:  # not PEM, encrypted, unreadable
        raise InputError(f"{path}: not a usable PEM {kind} key "
                         f"({str(error).splitlines()[0][:120]})") from None
    wanted = ec.EllipticCurvePrivateKey if private else ec.EllipticCurvePublicKey
    if not isinstance(key, wanted):
        name = type(key).__name__.lstrip("_").removesuffix("PrivateKey").removesuffix("PublicKey")
        raise InputError(f"{path}: an {name} key, not an elliptic-curve {kind} key (grpogate "
                         "signs with EC keys only: openssl ecparam -name prime256v1 -genkey)")


def sign_run(run_dir: str | Path, private_key: str | Path) -> Path:
    """Write RUN_DIR/run.sig over every file of the finished run; returns its path."""
    # Absolute, here and in verify_run: the library matches the paths it leaves out (run.sig,
    # the lock) against the model path it was given, and a relative RUN_DIR matched neither.
    run_dir = Path(run_dir).resolve()
    if not (run_dir / "manifest.json").is_file():
        raise InputError(f"{run_dir}: not a finished run (no manifest.json); only a finished "
                         "run can be signed")
    if not Path(private_key).is_file():
        raise InputError(f"{private_key}: no such private key file")
    hashing, signing, _ = _library()
    _elliptic_key(private_key, private=True)
    signature = run_dir / SIGNATURE_FILE
    if os.path.lexists(signature) and not stat.S_ISREG(os.lstat(signature).st_mode):
        raise InputError(f"{signature}: a symbolic link, FIFO or device, not a signature "
                         "grpogate wrote; grpogate writes nothing through it (remove it first)")
    # The library writes the bundle wherever it is told, following a symlink planted at
    # run.sig: it writes into a private temporary folder, and the bytes reach the run directory
    # through write_in_run_dir (no link followed).
    with RunDirLock(run_dir), tempfile.TemporaryDirectory(prefix="grpogate-sign-") as scratch:
        try:
            (signing.Config().set_hashing_config(_hashing_config(hashing, run_dir))
             .use_elliptic_key_signer(private_key=private_key)
             .sign(run_dir, Path(scratch) / SIGNATURE_FILE))
        except ValueError as error:  # not a PEM private key, wrong curve
            raise InputError(f"{private_key}: cannot sign with this key ({error})") from None
        write_in_run_dir(run_dir, SIGNATURE_FILE, (Path(scratch) / SIGNATURE_FILE).read_bytes(),
                         file_mode())
    return run_dir / SIGNATURE_FILE


def verify_run(run_dir: str | Path, public_key: str | Path) -> str | None:
    """None when RUN_DIR/run.sig verifies with `public_key`, else why not (a mismatch to name)."""
    run_dir = Path(run_dir).resolve()
    if not Path(public_key).is_file():
        raise InputError(f"{public_key}: no such public key file")
    if not (run_dir / SIGNATURE_FILE).is_file():
        return f"{SIGNATURE_FILE} missing: the run is not signed"
    hashing, _, verifying = _library()
    _elliptic_key(public_key, private=False)
    if (run_dir / LOCK_FILE).exists():  # the one path the signature leaves out
        return (f"{LOCK_FILE} present: a grpogate process is writing the run, or a file was "
                "put under the lock's name")
    try:
        (verifying.Config().set_hashing_config(_hashing_config(hashing, run_dir))
         .use_elliptic_key_verifier(public_key=public_key)
         .verify(run_dir, run_dir / SIGNATURE_FILE))
    except Exception as error:  # noqa: BLE001 - whatever the library raises, it did not verify
        # A damaged run.sig fails in the bundle parser, the JSON reader or the signature check.
        reason = (str(error).splitlines() or [""])[0][:200]
        return (f"{SIGNATURE_FILE} does not verify with {public_key}: "
                f"{type(error).__name__} {reason}".rstrip())
    return None
