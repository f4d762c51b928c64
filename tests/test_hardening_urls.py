"""Issue 17, classes 7 and 8: no credential in a database URL ever reaches an output,
on success or on error, and a connection failure is reported in kvledger's own words.
Plus the URL fuzz: any hostile --db gives exit 2, one coded line, no traceback, no secret,
and an existing journal untouched."""

from __future__ import annotations

import json
import string
import time
from urllib.parse import quote, quote_plus

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import make_url

from kvledger.journal.url import parse_url, redact
from kvledger.migrations.storage import init_database
from kvledger.schemas.errors import KvLedgerError

from hardening_db import (
    CODES,
    PASSWORD,
    cli,
    cli_process,
    conninfo,
    password_role,
    refused,
    snapshot,
)

SECRET = "Zq7XkPw2"  # distinctive: any occurrence in an output is a leak


# -- redact ------------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    f"postgresql+psycopg://u:{SECRET}@h:5432/db",
    f"postgresql+psycopg://u@h/db?password={SECRET}",
    f"postgresql+psycopg://h/db?user=u&password={SECRET}",
    f"postgresql+psycopg://h/db?password=a&password={SECRET}",
    f"postgresql+psycopg://h/db?passfile=/home/{SECRET}/.pgpass",
    f"postgresql+psycopg://h/db?sslkey=/k/{SECRET}.key&sslpassword={SECRET}",
    f"postgresql+psycopg://h/db?options=-c%20x%3D{SECRET}",
    f"postgresql+psycopg://h/db?PASSWORD={SECRET}",
    f"postgresql+psycopg://h/db?password=ab&{SECRET}=x",  # an unencoded & inside a password
    f"postgresql+psycopg://u:{quote(SECRET + '@:/?#', safe='')}@h/db",
    f"postgresql+psycopg://u:{SECRET}@h/db?application_name=ok&sslmode=require",
    f"sqlite:///file:j.db?uri=true&password={SECRET}",
])
def test_redact_hides_every_credential_and_keeps_the_rest(url):
    shown = redact(url)
    assert SECRET not in shown
    u = make_url(url)
    assert shown.startswith(u.set(query={}).render_as_string(hide_password=True))  # all but the query
    for key, value in u.query.items():
        if key in ("application_name", "sslmode", "user", "uri"):
            assert f"{key}={quote_plus(value)}" in shown  # harmless options stay readable


def test_the_admin_connection_keeps_the_urls_libpq_options():
    """What the journal's engine reads from a URL, the admin connections of crash-test's
    and the tests' scratch databases read too: a Unix socket's directory and port given
    in the query, TLS options; only what is overridden changes."""
    from kvledger.journal.pgserver import conninfo as admin_conninfo

    info = psycopg.conninfo.conninfo_to_dict(admin_conninfo(
        f"postgresql://kv:{SECRET}@/kv?host=/run/postgresql&port=5433&sslmode=verify-full&sslrootcert=/etc/ca.pem",
        dbname="scratch"))
    assert info == {"host": "/run/postgresql", "port": "5433", "user": "kv", "password": SECRET, "dbname": "scratch",
                    "sslmode": "verify-full", "sslrootcert": "/etc/ca.pem"}


def test_a_password_with_an_unencoded_at_is_refused_without_echo():
    for url in (f"postgresql+psycopg://u:ab@{SECRET}@127.0.0.1:1/db",
                f"postgresql+psycopg://u:ab@c/{SECRET}@127.0.0.1:1/db",
                f"sqlite://u:ab@{SECRET}@/x.db"):
        with pytest.raises(KvLedgerError) as info:
            parse_url(url)
        assert info.value.code.value == "BAD_DATABASE_URL" and SECRET not in str(info.value)
        assert SECRET not in redact(url)


# -- success paths -----------------------------------------------------------------------

def _secret_urls(pg_admin) -> tuple[str, str]:
    """Two migrated PostgreSQL journals, named with a password in the user info and one
    in the query (the server trusts the test role, so any password logs in)."""
    urls = []
    for _ in range(2):
        u = make_url(pg_admin.create())
        urls.append(u.set(password=SECRET + "a").update_query_dict({"password": SECRET + "b",
                                                                  "application_name": "t"})
                    .render_as_string(hide_password=False))
    return urls[0], urls[1]


def test_no_command_prints_a_password_on_success(pg_admin, tmp_path):
    src, dst = _secret_urls(pg_admin)
    out = tmp_path / "out.jsonl"
    runs = {
        "init": cli("init", "--db", src),
        "init --json": cli("init", "--db", src, "--json"),
        "demo --json": cli_process("demo", "--db", src, "--requests", "1", "--max-new-tokens", "2", "--json",
                                   "--telemetry", str(tmp_path / "t.jsonl")),
        "demo": cli_process("demo", "--db", src, "--requests", "1", "--max-new-tokens", "2"),
        "verify": cli("verify", "--db", src),
        "verify --json": cli("verify", "--db", src, "--json"),
        "replay": cli("replay", "--db", src),
        "replay --json": cli("replay", "--db", src, "--json"),
        "export": cli("export", "--db", src, "--out", str(out)),
        "import --json": cli("import", "--db", dst, str(out), "--json"),
        "reconcile": cli("reconcile", "--db", src, "--telemetry", str(tmp_path / "t.jsonl"), "--json"),
        "recover --json": cli("recover", "--db", src, "--no-continue", "--json"),
    }
    for name, (rc, stdout, stderr) in runs.items():
        assert rc == 0, (name, stdout, stderr)
        assert SECRET not in stdout + stderr, name
    # the outputs that name the journal show where a password was
    assert "password=***" in runs["demo --json"][1] and ":***@" in runs["demo --json"][1]
    assert "next: kvledger verify --db" in runs["demo"][1]
    query = make_url(json.loads(runs["verify --json"][1])["source"]).query
    assert query["password"] == "***" and query["application_name"] == "t"


# -- error paths -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def role_url(pg_admin):
    url = password_role(pg_admin)
    if url is None:
        pytest.skip("needs the throwaway test server (its pg_hba.conf is edited)")
    u = make_url(url)
    deadline = time.monotonic() + 10
    while True:  # pg_reload_conf() is asynchronous: wait until a wrong password is refused
        try:
            psycopg.connect(conninfo(u.set(password="wrong").render_as_string(hide_password=False))).close()
        except psycopg.OperationalError:
            break
        assert time.monotonic() < deadline, "the server never started asking for a password"
        time.sleep(0.1)
    return u


def test_wrong_password_is_reported_in_our_own_words(role_url):
    """The password is never shown, and not by masking it inside the driver's message: a
    short password ('e', 'a') would then show up as *** inside other words."""
    port = role_url.port
    cases = [
        role_url.set(password=SECRET),
        role_url.set(password="e"),
        role_url.set(password="a@b:c/d"),  # percent-encoded in the rendered URL
        role_url.update_query_dict({"password": SECRET}),
        role_url.update_query_dict({"password": "e", "sslmode": "disable"}),
    ]
    for u in cases:
        url = u.render_as_string(hide_password=False)
        line = refused(cli("verify", "--db", url), "DATABASE_AUTH_FAILED", SECRET)
        assert line == ("DATABASE_AUTH_FAILED: PostgreSQL at 127.0.0.1:"
                        f"{port}, database postgres: the server refused the credentials (OperationalError)")
    # the right password logs in (so the refusals above were about the password)
    ok = role_url.set(password=PASSWORD).render_as_string(hide_password=False)
    rc, stdout, _ = cli("init", "--db", ok)
    assert rc == 0 and PASSWORD not in stdout


def test_an_unreachable_server_is_reported_in_our_own_words():
    url = f"postgresql+psycopg://u:{SECRET}@127.0.0.1:1/kvl?password={SECRET}&connect_timeout=3"
    for cmd in (["verify"], ["replay"], ["export", "--out", "-"], ["init"], ["recover"]):
        line = refused(cli(*cmd, "--db", url), "DATABASE_UNREACHABLE", SECRET)
        assert line == ("DATABASE_UNREACHABLE: PostgreSQL at 127.0.0.1:1, database kvl: cannot connect, "
                        "or the connection was lost (OperationalError)")


@pytest.mark.parametrize("option", ["sslmode=nope", "keepalives=abc", "target_session_attrs=bogus"])
def test_an_option_value_libpq_refuses_is_a_bad_url_not_an_unreachable_server(pg_admin, option):
    """libpq checks an option's value only as it connects: a server that is up and a value
    it cannot take is the URL's fault (BAD_DATABASE_URL, not retried), not the server's."""
    url = f"{pg_admin.create()}?{option}"
    line = refused(cli("verify", "--db", url), "BAD_DATABASE_URL")
    assert line.endswith(": libpq refuses an option value of the URL (OperationalError)"), line


# -- fuzz --------------------------------------------------------------------------------

# Characters a secret may hold around its distinctive core: URL delimiters, percent
# signs, spaces and control characters included.
_NOISE = string.ascii_letters + string.digits + "@:/?#&=%+ ;,'\"\\\n\r\t\x7f\u2028é"
_SCHEMES = st.sampled_from(["sqlite", "sqlite+pysqlite", "postgresql", "postgres", "postgresql+psycopg",
                            "SQLITE", "mysql", "postgresql+asyncpg", "http", "file", "sqlite+", ""])
# Where a credential goes in a query; other options are drawn with values of their own.
_SECRET_KEYS = st.sampled_from(["password", "PASSWORD", "passfile", "sslpassword", "sslkey", "options",
                                "pass", "secret"])
_OTHER_KEYS = st.sampled_from(["user", "timeout", "connect_timeout", "application_name", "mode", "uri",
                               "sslmode", "x" * 300])


def _noise(draw, alphabet: str = _NOISE) -> str:
    return draw(st.text(alphabet=alphabet, max_size=12))


@st.composite
def hostile_urls(draw, root: str):
    """A URL with the secret in a credential position (user info or a credential option,
    raw or percent-encoded), and the rest hostile too: odd schemes, ports, control
    characters, huge values. SQLite paths stay inside `root`."""
    where = draw(st.sampled_from(["userinfo", "userinfo-encoded", "query", "query-raw", "query-twice"]))
    # A raw & or # in a query value ends it: what follows is another option by definition.
    alphabet = _NOISE.replace("&", "").replace("#", "") if where == "query-raw" else _NOISE
    secret = _noise(draw, alphabet) + SECRET + _noise(draw, alphabet)
    scheme = draw(_SCHEMES)
    host = draw(st.sampled_from(["127.0.0.1", "[::1]", "localhost", "", "127.0.0.1:abc", "h\nSTALE_BASE: x"]))
    port = draw(st.sampled_from([":1", ":0", ":99999", ":-1"]))
    sqlite = scheme.lower().startswith("sqlite")
    database = draw(st.sampled_from(
        [f"/{root}/missing/j.db", f"/{root}/notadb", f"/{root}/adir", f"/{root}/" + "d" * 5000,
         f"/{root}/a\nSTALE_BASE: x/j.db", f"/{root}/nul\x00.db"]
        if sqlite else ["/kvl", "", "/" + "d" * 5000, "/a\nSTALE_BASE: b"]))
    user = draw(st.sampled_from(["u", "", "postgres", "u\nv"]))
    query = [f"{quote_plus(k)}={quote_plus(v)}"
             for k, v in draw(st.lists(st.tuples(_OTHER_KEYS, st.text(max_size=8)), max_size=3))]
    if where.startswith("userinfo"):
        authority = f"{user}:{secret if where == 'userinfo' else quote(secret, safe='')}@{host}{port}"
    else:
        authority = f"{user}@{host}{port}" if user else f"{host}{port}"
        value = secret if where == "query-raw" else quote_plus(secret)
        query.append(f"{quote_plus(draw(_SECRET_KEYS))}={value}")
        if where == "query-twice":
            query.append(f"password={quote_plus(secret)}")
    if sqlite and where.startswith("query") and draw(st.booleans()):
        authority = ""  # a well-formed sqlite:/// URL, its secret in the query
    url = f"{scheme}://{authority}{database}"
    return url + ("?" + "&".join(query) if query else ""), secret


@pytest.fixture(scope="module")
def fuzz_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "notadb").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    (root / "adir").mkdir()
    journal = root / "journal.db"
    init_database(f"sqlite:///{journal}")
    return root, f"sqlite:///{journal}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_hostile_urls_exit_2_in_one_coded_line_without_the_secret(fuzz_dirs, data):
    root, journal = fuzz_dirs
    url, secret = data.draw(hostile_urls(str(root).lstrip("/")))
    before = snapshot(journal)
    command = data.draw(st.sampled_from([["verify"], ["replay", "--json"], ["export", "--out", "-"],
                                         ["recover", "--no-continue"], ["init"]]))
    rc, out, err = cli(*command, f"--db={url}")
    lines = err.splitlines()
    assert rc == 2, (url, rc, out, err)
    assert len(lines) == 1 and lines[0].split(":", 1)[0] in CODES, (url, err)
    assert "Traceback" not in out + err
    # the secret's distinctive core, and the secret itself, appear nowhere
    assert SECRET not in out + err and secret not in out + err, (url, err)
    assert snapshot(journal) == before


def test_fuzz_examples_as_subprocesses(fuzz_dirs):
    """A few hostile URLs through a real process (argument parsing, the environment
    variable, interpreter start-up): the same one line, no traceback, no secret."""
    root, journal = fuzz_dirs
    before = snapshot(journal)
    for url in (f"postgresql://u:{SECRET}@127.0.0.1:1/kvl?password={SECRET}",
                f"postgresql://u:ab@{SECRET}@127.0.0.1:1/kvl",
                f"sqlite://u:{SECRET}@x/j.db",
                f"sqlite:///{root}/notadb?timeout=abc&password={SECRET}",
                f"mysql://u:{SECRET}@h/d"):
        refused(cli_process("verify", f"--db={url}"), lines_code(cli("verify", f"--db={url}")), SECRET)
        refused(cli_process("replay", env={"KVLEDGER_DB": url}),
                lines_code(cli("replay", f"--db={url}")), SECRET)
    assert snapshot(journal) == before


def lines_code(result: tuple[int, str, str]) -> str:
    return result[2].split(":", 1)[0]


# -- refused before any connection, saying why -------------------------------------------

@pytest.mark.parametrize("url, why", [
    ("sqlite:////tmp/j\x00.db", "holds a NUL character"),  # from the API: argv holds no NUL
    ("sqlite:////tmp/" + "x" * 300 + "/j.db", "the operating system refuses the file name"),  # over NAME_MAX
    ("postgresql+psycopg://h/db?nosuchoption=1", "an unknown option"),
    ("nats://127.0.0.1:4222/cell?timeout=1&timeout=2", "a repeated option"),
    ("nats://127.0.0.1:4222/cell?colour=red", "an unknown option"),
    ("nats://127.0.0.1:4222/cell?replicas=7", "replicas is 1 to 5"),
    ("nats://127.0.0.1:4222/cell?timeout=0", "timeout is a number of seconds"),
    ("nats://127.0.0.1:4222/cell?timeout=soon", "timeout is a number of seconds"),
], ids=["nul", "long-name", "libpq-option", "repeated-option", "unknown-option", "replicas", "timeout-0",
        "timeout-word"])
def test_a_url_refused_before_any_connection_says_why(url, why):
    with pytest.raises(KvLedgerError) as err:
        parse_url(url)
    assert err.value.code.value == "BAD_DATABASE_URL" and why in err.value.message, err.value


def test_a_file_name_in_a_symlink_loop_is_a_bad_url(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(KvLedgerError) as err:
        parse_url(f"sqlite:///{tmp_path}/a/j.db")
    assert err.value.code.value == "BAD_DATABASE_URL" and "refuses the file name" in err.value.message
