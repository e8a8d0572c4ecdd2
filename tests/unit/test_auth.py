"""runtime.wire.auth against a real gRPC server on 127.0.0.1 (no mocks)."""

import datetime
import ipaddress
import threading
from concurrent import futures

import grpc
import pytest

from runtime.wire.auth import (
    METADATA_KEY,
    Refusals,
    SecretServerInterceptor,
    channel_credentials,
    new_secret,
    peer_host,
    secure_channel,
    server_credentials,
)

SERVICE = "test.Auth"
ECHO = f"/{SERVICE}/Echo"
JOIN = f"/{SERVICE}/Join"
SPLIT = f"/{SERVICE}/Split"
PING = f"/{SERVICE}/Ping"
TIMEOUT = 5
_ident = lambda b: b  # noqa: E731


def _handlers():
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"echo:" + req, _ident, _ident),
            "Join": grpc.stream_unary_rpc_method_handler(lambda it, ctx: b"+".join(it), _ident, _ident),
            "Split": grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter(req.split(b",")), _ident, _ident),
            "Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"pong", _ident, _ident),
        },
    )


def _start(interceptor, creds=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[interceptor])
    server.add_generic_rpc_handlers((_handlers(),))
    port = server.add_secure_port("127.0.0.1:0", creds) if creds else server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class _Stubs:
    def __init__(self, channel):
        self.echo = channel.unary_unary(ECHO, _ident, _ident)
        self.join = channel.stream_unary(JOIN, _ident, _ident)
        self.split = channel.unary_stream(SPLIT, _ident, _ident)
        self.ping = channel.unary_unary(PING, _ident, _ident)


@pytest.fixture
def served():
    """(secret, address, refusals): a server that wants ``secret``; refusals lists on_refused calls
    as ``(method, "reason from peer")``."""
    secret, refusals, lock = new_secret(), [], threading.Lock()

    def on_refused(method, peer, reason):
        with lock:
            refusals.append((method, f"{reason} from {peer}"))

    server, address = _start(SecretServerInterceptor(secret, on_refused=on_refused, exempt=frozenset({PING})))
    yield secret, address, refusals
    server.stop(None)


@pytest.fixture
def client():
    channels = []

    def make(address, secret=None):
        channel = grpc.insecure_channel(address)
        channels.append(channel)
        return _Stubs(secure_channel(channel, secret) if secret is not None else channel)

    yield make
    for c in channels:
        c.close()


def _assert_refused(call, method):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.value.details() == f"missing or wrong run secret for {method}"


def test_new_secret_is_fresh_hex():
    a, b = new_secret(), new_secret()
    assert a != b and len(a) == 32 and int(a, 16) >= 0


def test_right_secret_passes_every_arity(served, client):
    secret, address, refusals = served
    stubs = client(address, secret)
    assert stubs.echo(b"hi", timeout=TIMEOUT) == b"echo:hi"
    assert stubs.echo.future(b"fut", timeout=TIMEOUT).result(timeout=TIMEOUT) == b"echo:fut"
    resp, call = stubs.echo.with_call(b"wc", timeout=TIMEOUT, metadata=[("x-other", "1")])
    assert resp == b"echo:wc" and call.code() == grpc.StatusCode.OK
    assert stubs.join(iter([b"a", b"b", b"c"]), timeout=TIMEOUT) == b"a+b+c"
    assert stubs.join.future(iter([b"x", b"y"]), timeout=TIMEOUT).result(timeout=TIMEOUT) == b"x+y"
    assert list(stubs.split(b"1,2,3", timeout=TIMEOUT)) == [b"1", b"2", b"3"]
    assert refusals == []


def test_missing_secret_is_unauthenticated(served, client):
    _, address, refusals = served
    stubs = client(address)
    _assert_refused(lambda: stubs.echo(b"hi", timeout=TIMEOUT), ECHO)
    _assert_refused(lambda: stubs.echo.future(b"hi", timeout=TIMEOUT).result(timeout=TIMEOUT), ECHO)
    _assert_refused(lambda: stubs.join(iter([b"a", b"b"]), timeout=TIMEOUT), JOIN)
    _assert_refused(lambda: list(stubs.split(b"1,2", timeout=TIMEOUT)), SPLIT)
    assert [m for m, _ in refusals] == [ECHO, ECHO, JOIN, SPLIT]
    assert all("missing" in reason for _, reason in refusals)


def test_wrong_secret_is_unauthenticated(served, client):
    secret, address, refusals = served
    stubs = client(address, new_secret())
    _assert_refused(lambda: stubs.echo(b"hi", timeout=TIMEOUT), ECHO)
    _assert_refused(lambda: stubs.join(iter([b"a"]), timeout=TIMEOUT), JOIN)
    # A secret sent by hand, but wrong, is refused too; so is the right one next to a wrong one.
    raw = client(address)
    _assert_refused(lambda: raw.echo(b"hi", timeout=TIMEOUT, metadata=[(METADATA_KEY, secret[:-1])]), ECHO)
    _assert_refused(lambda: client(address, secret).echo(b"hi", timeout=TIMEOUT, metadata=[(METADATA_KEY, "x")]), ECHO)
    assert [m for m, _ in refusals] == [ECHO, JOIN, ECHO, ECHO]
    assert all("wrong" in reason for _, reason in refusals)


def test_on_refused_names_method_and_peer(served, client):
    _, address, refusals = served
    _assert_refused(lambda: client(address, "nope").echo(b"hi", timeout=TIMEOUT), ECHO)
    [(method, reason)] = refusals
    assert method == ECHO
    assert "127.0.0.1" in reason


def test_exempt_method_needs_no_secret(served, client):
    secret, address, refusals = served
    assert client(address).ping(b"", timeout=TIMEOUT) == b"pong"
    assert client(address, "wrong").ping(b"", timeout=TIMEOUT) == b"pong"
    assert client(address, secret).ping(b"", timeout=TIMEOUT) == b"pong"
    assert refusals == []


def test_unknown_method_is_still_unimplemented(served, client):
    _, address, _ = served
    channel = grpc.insecure_channel(address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(f"/{SERVICE}/Nope", _ident, _ident)(b"", timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()


def test_empty_secret_is_rejected():
    with pytest.raises(ValueError):
        SecretServerInterceptor("")
    with pytest.raises(ValueError):
        secure_channel(grpc.insecure_channel("127.0.0.1:1"), "")


def test_credentials_name_missing_files(tmp_path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(FileNotFoundError, match="nope.pem"):
        server_credentials(missing, missing)
    with pytest.raises(FileNotFoundError, match="nope.pem"):
        channel_credentials(ca_file=missing)
    with pytest.raises(ValueError, match="key_file"):
        channel_credentials(cert_file=missing)
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.pem"):
        channel_credentials(ca_file=empty)


def _self_signed(tmp_path):
    """A self-signed CA-capable cert for 127.0.0.1/localhost; returns (cert_file, key_file)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


def test_mutual_tls_with_secret(tmp_path):
    cert, key = _self_signed(tmp_path)
    secret = new_secret()
    server, address = _start(SecretServerInterceptor(secret), server_credentials(cert, key, ca_file=cert))
    try:
        good = grpc.secure_channel(address, channel_credentials(ca_file=cert, cert_file=cert, key_file=key))
        no_client_cert = grpc.secure_channel(address, channel_credentials(ca_file=cert))
        try:
            stubs = _Stubs(secure_channel(good, secret))
            assert stubs.echo.future(b"tls", timeout=TIMEOUT).result(timeout=TIMEOUT) == b"echo:tls"
            _assert_refused(lambda: _Stubs(good).echo(b"tls", timeout=TIMEOUT), ECHO)
            with pytest.raises(grpc.RpcError) as err:
                _Stubs(secure_channel(no_client_cert, secret)).echo(b"tls", timeout=TIMEOUT)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            good.close()
            no_client_cert.close()
    finally:
        server.stop(None)


# -- Refusals: counts of refused calls, for the security events -------------------------------


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:10.0.0.1:5123") == "ipv4:10.0.0.1"
    assert peer_host("ipv6:[::1]:5123") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_refusals_count_per_method_host_and_reason_and_drain_once():
    refusals = Refusals()
    for port in range(50, 60):   # one caller, a new port per connection
        refusals.record(ECHO, f"ipv4:10.0.0.1:{port}", "missing run secret")
    refusals.record(ECHO, "ipv4:10.0.0.2:1", "wrong run secret")
    refusals.record(JOIN, "ipv4:10.0.0.1:9", "missing run secret")
    assert refusals.drain() == [(ECHO, "ipv4:10.0.0.1", "missing run secret", 10),
                                (ECHO, "ipv4:10.0.0.2", "wrong run secret", 1),
                                (JOIN, "ipv4:10.0.0.1", "missing run secret", 1)]
    assert refusals.drain() == []


def test_refusals_keep_a_bounded_number_of_keys():
    refusals = Refusals(max_keys=3)
    for host in range(10):
        refusals.record(ECHO, f"ipv4:10.0.0.{host}:1", "missing run secret")
    drained = refusals.drain()
    assert len(drained) == 4 and drained[0] == ("*", "*", "overflow", 7)
    assert sum(n for *_, n in drained) == 10


def test_refusals_log_the_first_of_a_key_then_at_most_once_per_period(caplog):
    refusals = Refusals(log_seconds=3600)
    with caplog.at_level("WARNING", logger="runtime.wire.auth"):
        for _ in range(100):
            refusals.record(ECHO, "ipv4:10.0.0.1:5", "missing run secret")
        refusals.record(ECHO, "ipv4:10.0.0.9:5", "wrong run secret")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "10.0.0.1" in lines[0] and "10.0.0.9" in lines[1]
    every = Refusals(log_seconds=0)
    with caplog.at_level("WARNING", logger="runtime.wire.auth"):
        caplog.clear()
        for _ in range(3):
            every.record(ECHO, "ipv4:10.0.0.1:5", "missing run secret")
    since = [r.getMessage().endswith("(1 such calls since the last line)") for r in caplog.records]
    assert since == [False, True, True]


def test_a_server_counts_the_calls_it_refuses(client):
    secret, refusals = new_secret(), Refusals()
    server, address = _start(SecretServerInterceptor(secret, on_refused=refusals.record))
    try:
        for _ in range(3):
            _assert_refused(lambda: client(address).echo(b"hi", timeout=TIMEOUT), ECHO)
        _assert_refused(lambda: client(address, "nope").join(iter([b"a"]), timeout=TIMEOUT), JOIN)
        assert client(address, secret).echo(b"hi", timeout=TIMEOUT) == b"echo:hi"
        assert refusals.drain() == [(ECHO, "ipv4:127.0.0.1", "missing run secret", 3),
                                    (JOIN, "ipv4:127.0.0.1", "wrong run secret", 1)]
    finally:
        server.stop(None)
