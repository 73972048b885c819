"""The console driven by real clicks in headless Chromium (Playwright for Python, the system
Chromium), against a running `sluice billing` and a gateway on the same database.

tests/console.rs starts the processes and runs this with:
  CONSOLE_URL  the billing service (it serves /console)
  GATEWAY_URL  a gateway reading the same database
  SLUICE_BIN   the sluice binary (tokens, links and `sluice audit records`)
  SLUICE_JWT_SECRET, CHROMIUM, SHOTS (where screenshots go), TAG (unique ids), MODEL_ID
  ADAPTER_REVISIONS  registration bodies (less the name) of two revisions of one adapter,
                     oldest first, already checked and put in the engine's store
Each step asserts what a user would see; a failure exits non-zero naming the step.
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from playwright.sync_api import expect, sync_playwright

URL = os.environ["CONSOLE_URL"].rstrip("/")
GATEWAY = os.environ["GATEWAY_URL"].rstrip("/")
BIN = os.environ["SLUICE_BIN"]
SHOTS = os.environ["SHOTS"]
TAG = os.environ["TAG"]
MODEL = os.environ["MODEL_ID"]
ACME = f"acme-{TAG}"
GLOBEX = f"globex-{TAG}"
ADAPTER_REVISIONS = json.loads(os.environ["ADAPTER_REVISIONS"])
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def sluice(*args, token=None):
    env = dict(os.environ, SLUICE_ADMIN_URL=URL)
    if token:
        env["SLUICE_ADMIN_TOKEN"] = token
    out = subprocess.run([BIN, *args], env=env, capture_output=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"sluice {' '.join(args)}: {out.stderr.decode()}")
    return out.stdout


def token(role, tenant=None):
    extra = ["--tenant", tenant] if tenant else []
    return sluice("admin", "token", "--role", role, "--sub", f"{role}-tester", *extra).decode().strip()


def link(role, tenant=None):
    extra = ["--tenant", tenant] if tenant else []
    return sluice("admin", "console", "--role", role, "--sub", f"{role}-tester", *extra).decode().strip()


def http(method, url, bearer, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {bearer}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


EXTERNAL = []


def context(browser, **kw):
    """A fresh tab's context (its own sessionStorage) that notes any request leaving the service."""
    ctx = browser.new_context(**kw)
    ctx.on("request", lambda r: r.url.startswith((URL, "blob:", "data:")) or EXTERNAL.append(r.url))
    return ctx


def shot(page, name):
    path = os.path.join(SHOTS, f"{name}.png")
    page.screenshot(path=path, full_page=True)
    print(f"screenshot {path}")


def confirm(page):
    dialog = page.get_by_test_id("confirm")
    expect(dialog).to_be_visible()
    dialog.get_by_test_id("confirm-ok").click()
    expect(dialog).to_be_hidden()


def ops_flow(browser):
    ctx = context(browser)
    ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=URL)
    page = ctx.new_page()
    page.goto(link("ops"))
    expect(page.get_by_test_id("who")).to_contain_text("ops")
    assert "token" not in page.url, f"the token stayed in the URL: {page.url}"
    assert page.evaluate("localStorage.length") == 0, "something was written to localStorage"

    # Tenants: two created through the form, each confirmed.
    for tid, name in [(ACME, "Acme"), (GLOBEX, "Globex")]:
        page.goto(f"{URL}/console#/tenants")
        form = page.get_by_test_id("create-tenant")
        form.get_by_label("Tenant id").fill(tid)
        form.get_by_label("Display name").fill(name)
        form.get_by_role("button", name="Create tenant").click()
        confirm(page)
        expect(page.get_by_test_id("notice")).to_contain_text(f"Tenant {tid} created")
        expect(page.get_by_test_id("tenant-tier")).to_have_text("standard")
    page.goto(f"{URL}/console#/tenants")
    expect(page.locator(f'[data-tenant="{ACME}"]')).to_be_visible()
    shot(page, "ops-tenants")

    # A refused id is a message beside its field, not a blank page.
    form = page.get_by_test_id("create-tenant")
    form.get_by_label("Tenant id").fill("Not Valid!")
    form.get_by_role("button", name="Create tenant").click()
    confirm(page)
    expect(page.get_by_test_id("error")).to_contain_text("400")
    expect(form.locator('[data-error-for="id"]')).to_contain_text("a-z 0-9")

    # Keys: the secret shown once, copied, and working at the gateway.
    page.goto(f"{URL}/console#/tenant/{ACME}")
    page.get_by_test_id("issue-key").get_by_role("button", name="Issue key").click()
    confirm(page)
    secret = page.get_by_test_id("secret").inner_text().strip()
    assert secret.startswith("sk-"), secret
    page.get_by_test_id("copy-secret").click()
    expect(page.get_by_test_id("copy-status")).to_have_text("Copied.")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    shot(page, "ops-key-issued")
    page.reload()
    expect(page.get_by_test_id("keys")).to_be_visible()
    assert secret not in page.content(), "the secret is shown again after a reload"
    prefix = page.locator("[data-testid=keys] tbody tr").first.get_attribute("data-prefix")
    assert secret.startswith(prefix), (secret[:12], prefix)

    gateway_calls(secret)

    # A second key, revoked; the prefix filter shows one key at a time.
    page.get_by_test_id("issue-key").get_by_role("button", name="Issue key").click()
    confirm(page)
    second = page.get_by_test_id("secret").inner_text().strip()
    rows = page.locator("[data-testid=keys] tbody tr")
    expect(rows).to_have_count(2)
    page.get_by_role("button", name="I have stored it").click()
    prefixes = rows.evaluate_all("rs => rs.map((r) => r.dataset.prefix)")
    second_prefix = next(p for p in prefixes if second.startswith(p))
    second_row = page.locator(f'[data-testid=keys] tbody tr[data-prefix="{second_prefix}"]')
    second_id = second_row.get_attribute("data-key")
    second_row.get_by_role("button", name="Revoke").click()
    confirm(page)
    expect(page.get_by_test_id("notice")).to_contain_text("revoked")
    expect(page.locator("[data-testid=keys] tbody tr .status-revoked")).to_have_count(1)
    page.get_by_test_id("key-filter").fill(prefix)
    expect(page.locator("[data-testid=keys] tbody tr:visible")).to_have_count(1)
    status, body = http("POST", f"{GATEWAY}/v1/completions", second,
                        {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 401, f"a revoked key answered {status}: {body}"

    # Quota: an invalid value is named by the API beside its field; a valid one shows in the
    # effective limits and the audit log.
    quota = page.get_by_test_id("edit-quota")
    quota.get_by_label("Requests per minute").fill("-5")
    quota.get_by_role("button", name="Save quota").click()
    confirm(page)
    expect(quota.locator('[data-error-for="rpm"]')).to_contain_text("rpm must be")
    expect(page.get_by_test_id("error")).to_contain_text("400")
    shot(page, "ops-quota-invalid")
    quota.get_by_label("Requests per minute").fill("7")
    quota.get_by_label("Tokens per minute").fill("5000")
    quota.get_by_role("button", name="Save quota").click()
    confirm(page)
    expect(page.get_by_test_id("notice")).to_contain_text("saved")
    expect(page.get_by_test_id("effective-rpm")).to_have_text("7")
    expect(page.get_by_test_id("effective-tpm")).to_have_text("5000")
    shot(page, "ops-quota")

    # Tier change, suspend, activate: each confirmed; Cancel changes nothing.
    page.get_by_test_id("change-tier").get_by_role("button", name="Change tier").click()
    page.get_by_test_id("confirm").get_by_role("button", name="Cancel").click()
    expect(page.get_by_test_id("notice")).to_be_hidden()
    page.get_by_test_id("change-tier").get_by_label("Tier").select_option("enterprise")
    page.get_by_test_id("change-tier").get_by_role("button", name="Change tier").click()
    confirm(page)
    expect(page.get_by_test_id("tenant-tier")).to_have_text("enterprise")
    page.get_by_test_id("suspend").click()
    confirm(page)
    expect(page.get_by_test_id("tenant-status")).to_have_text("suspended")
    page.get_by_test_id("activate").click()
    confirm(page)
    expect(page.get_by_test_id("tenant-status")).to_have_text("active")

    # Every change is in the audit log, with what it changed.
    page.get_by_role("link", name="Audit log").click()
    log = page.get_by_test_id("audit-log")
    for action in ["tenant.create", "key.issue", "quota.set", "tenant.update", "tenant.suspend",
                   "tenant.activate"]:
        # Key rows target key:ID; the diff names the tenant.
        rows = log.locator(f'tr[data-action="{action}"]').filter(has_text=ACME)
        expect(rows.first).to_be_visible()
    revoke = log.locator(f'tr[data-action="key.revoke"][data-target="key:{second_id}"]')
    expect(revoke).to_contain_text("revoked_at")
    quota_row = log.locator('tr[data-action="quota.set"]').last
    expect(quota_row).to_contain_text("overrides.rpm")
    expect(quota_row).to_contain_text("7")
    expect(log.locator('tr[data-action="tenant.update"]').last).to_contain_text('"enterprise"')
    shot(page, "ops-audit-log")
    ctx.close()
    return secret


def gateway_calls(secret):
    """Requests with the new key: three cut by max_tokens (finish `length`), and Globex's."""
    for i in range(3):
        status, body = http("POST", f"{GATEWAY}/v1/completions", secret,
                            {"model": MODEL, "prompt": f"Count to {i + 3}:", "max_tokens": 2})
        assert status == 200, f"the new key was refused by the gateway: {status} {body}"
        assert body["choices"][0]["finish_reason"] == "length", body
    status, body = http("POST", f"{GATEWAY}/v1/completions", secret,
                        {"model": "no-such-model", "prompt": "x", "max_tokens": 2})
    assert status == 404, (status, body)


def wait_records(auditor, tenant, n):
    deadline = time.time() + 60
    while time.time() < deadline:
        status, body = http("GET", f"{URL}/v1/records?tenant={tenant}&limit=1000", auditor)
        assert status == 200, body
        if len(body["records"]) >= n:
            return body["records"]
        time.sleep(0.3)
    raise AssertionError(f"{tenant}'s {n} records never reached the ledger")


def auditor_flow(browser):
    auditor = token("auditor")
    records = wait_records(auditor, ACME, 4)
    lengths = [r for r in records if r["finish_reason"] == "length"]
    assert len(lengths) == 3, [r["finish_reason"] for r in records]

    ctx = context(browser, accept_downloads=True)
    page = ctx.new_page()
    page.goto(link("auditor"))
    expect(page.get_by_test_id("who")).to_contain_text("auditor")
    filters = page.get_by_test_id("record-filters")
    filters.get_by_label("Tenant").fill(ACME)
    filters.get_by_label("Finish reason").fill("length")
    filters.get_by_role("button", name="Apply filters").click()
    rows = page.locator("[data-testid=records] tbody tr")
    expect(rows).to_have_count(3)
    for i in range(3):
        expect(rows.nth(i)).to_contain_text(ACME)
        expect(rows.nth(i)).to_contain_text("length")
    # A record's whole row, by keyboard: focus it and press Enter.
    rows.nth(1).focus()
    page.keyboard.press("Enter")
    detail = page.get_by_test_id("record-detail")
    want = lengths[1]
    for field in ["request_id", "model_revision", "tokenizer_revision", "engine_version",
                  "price_list_version", "ttft_ms", "engine_queue_ms", "prompt_sha256"]:
        expect(detail.locator(f'dd[data-field="{field}"]')).to_have_text(
            "–" if want[field] is None else str(want[field]))
    assert "Count to" not in page.content(), "prompt text reached the page"
    shot(page, "auditor-records")

    cli = {}
    for fmt in ["csv", "jsonl"]:
        with page.expect_download() as dl:
            page.get_by_test_id(f"export-{fmt}").click()
        path = os.path.join(SHOTS, f"export.{fmt}")
        dl.value.save_as(path)
        got = open(path, "rb").read()
        cli[fmt] = sluice("audit", "records", "--tenant", ACME, "--finish-reason", "length",
                          "--format", fmt, "--limit", "100000", token=auditor)
        assert got == cli[fmt], f"the console's {fmt} differs from `sluice audit records`:\n{got!r}\n{cli[fmt]!r}"
        print(f"export {fmt}: {len(got.splitlines())} lines equal to sluice audit records")
    assert len(cli["csv"].splitlines()) == 4, cli["csv"]

    # Keyset pages of two records, forward and back.
    page.goto(f"{URL}/console#/records?tenant={ACME}&limit=2")
    expect(rows).to_have_count(2)
    first_page = rows.evaluate_all("rs => rs.map((r) => r.dataset.request)")
    page.get_by_test_id("next-page").click()
    # The old page's rows stay until the next one is drawn: wait for it before reading.
    expect(rows.first).not_to_have_attribute("data-request", first_page[0])
    expect(rows).to_have_count(2)
    second_page = rows.evaluate_all("rs => rs.map((r) => r.dataset.request)")
    assert not set(first_page) & set(second_page), (first_page, second_page)
    assert sorted(first_page + second_page) == sorted(r["request_id"] for r in records)
    page.get_by_test_id("prev-page").click()
    expect(rows.first).to_have_attribute("data-request", first_page[0])
    page.get_by_role("link", name="Audit log").click()
    expect(page.get_by_test_id("audit-log").locator('tr[data-action="quota.set"]').first).to_be_visible()
    shot(page, "auditor-audit-log")
    page.get_by_role("link", name="Reconciliation").click()
    expect(page.get_by_test_id("reconcile-verdict")).to_contain_text("agree")
    shot(page, "auditor-reconcile")
    # Ops pages are not the auditor's: a message, and the API refuses too.
    page.goto(f"{URL}/console#/tenants")
    expect(page.get_by_test_id("error")).to_contain_text("403")
    ctx.close()


def tenant_admin_flow(browser, secret):
    ctx = context(browser)
    page = ctx.new_page()
    page.goto(link("tenant-admin", ACME))
    expect(page.get_by_test_id("who")).to_contain_text(ACME)
    keys = page.locator("[data-testid=keys] tbody tr")
    expect(keys).to_have_count(2)
    prefixes = keys.evaluate_all("rs => rs.map((r) => r.dataset.prefix)")
    assert any(secret.startswith(p) for p in prefixes), prefixes
    expect(page.get_by_test_id("usage-totals")).to_contain_text("3 requests")
    shot(page, "tenant-admin")
    page.goto(f"{URL}/console#/tenant/{GLOBEX}")
    expect(page.get_by_test_id("error")).to_contain_text("403")
    expect(page.get_by_test_id("error")).to_contain_text("only its own tenant")
    assert GLOBEX not in page.get_by_test_id("view").inner_text()
    shot(page, "tenant-admin-other-tenant")
    admin = token("tenant-admin", ACME)
    for path in [f"/v1/tenants/{GLOBEX}", f"/v1/tenants/{GLOBEX}/keys", "/v1/tenants",
                 f"/v1/usage?tenant={GLOBEX}"]:
        status, body = http("GET", URL + path, admin)
        assert status == 403, f"tenant-admin of {ACME} read {path}: {status} {body}"
    ctx.close()


def billing_flow(browser):
    ctx = context(browser)
    page = ctx.new_page()
    page.goto(link("billing"))
    expect(page.get_by_test_id("open-dashboard")).to_be_visible()
    page.goto(f"{URL}/console#/tenants")
    expect(page.get_by_test_id("error")).to_contain_text("Access denied (403)")
    expect(page.get_by_test_id("error")).to_contain_text("ops")
    shot(page, "billing-denied-ops")
    billing = token("billing")
    for method, path in [("GET", "/v1/tenants"), ("POST", "/v1/tenants"),
                         ("GET", f"/v1/tenants/{ACME}/keys"), ("GET", "/v1/records")]:
        status, body = http(method, URL + path, billing, {} if method == "POST" else None)
        assert status == 403, f"billing reached {method} {path}: {status} {body}"
        assert body["error"]["message"], body
    # The dashboard opens signed in from the console, in the same tab.
    page.goto(f"{URL}/console#/billing")
    page.get_by_test_id("open-dashboard").click()
    expect(page.locator("body")).to_have_attribute("data-state", "ready", timeout=20000)
    shot(page, "billing-dashboard")
    ctx.close()


def adapter_rows(page, ref):
    return page.locator(f'[data-testid=adapters] tbody tr[data-adapter="{ref}"]')


def hash_query(page):
    """The console's filters as its URL's fragment holds them."""
    fragment = urllib.parse.urlsplit(page.url).fragment
    return urllib.parse.parse_qs(fragment.partition("?")[2])


def adapter_flow(browser):
    """Globex's adapter `support`, two revisions registered through the API as `sluice admin
    adapters register` does: listed for ops and Globex's admin, unseen by Acme's until Globex's
    admin shares it in the console, run through the gateway, found by the records explorer's
    adapter filter, and retired in the console, one revision and then the name."""
    ops = token("ops")
    ref = f"{GLOBEX}/support"
    old, new = (r["revision"] for r in ADAPTER_REVISIONS)
    for body in ADAPTER_REVISIONS:
        status, got = http("POST", f"{URL}/v1/tenants/{GLOBEX}/adapters", ops, {"name": "support", **body})
        assert status == 201 and got["status"] == "active", (status, got)

    # Requests on it: the name alone runs the newest revision, a pinned one its own; and one
    # on the bare model, which the adapter filter must leave out.
    status, key = http("POST", f"{URL}/v1/tenants/{GLOBEX}/keys", ops, {})
    assert status == 201, (status, key)
    for model in [ref, ref, f"{ref}@{old}", MODEL]:
        status, body = http("POST", f"{GATEWAY}/v1/completions", key["secret"],
                            {"model": model, "prompt": "Say hi.", "max_tokens": 2})
        assert status == 200, f"{model}: {status} {body}"

    # Ops: both revisions, the revision shortened with the whole one in its title.
    ctx = context(browser)
    page = ctx.new_page()
    page.goto(link("ops"))
    expect(page.get_by_test_id("who")).to_contain_text("ops")
    page.goto(f"{URL}/console#/tenant/{GLOBEX}")
    rows = adapter_rows(page, ref)
    expect(rows).to_have_count(2)
    for spec in ADAPTER_REVISIONS:
        rev = spec["revision"]
        row = page.locator(f'[data-testid=adapters] tbody tr[data-revision="{rev}"]')
        expect(row.locator(f'td[title="{rev}"]')).to_have_text(rev[:19] + "…")
        expect(row.locator("[data-field=status]")).to_have_text("active")
        expect(row.locator("[data-field=source]")).to_have_text("own")
        expect(row.locator("[data-field=shared-with]")).to_have_text("–")
        expect(row.locator("[data-field=base-model]")).to_have_text(spec["base_model"])
        expect(row.locator("[data-field=rank]")).to_have_text(str(spec["rank"]))
    expect(page.get_by_test_id("adapter-register-note")).to_contain_text(
        f"sluice admin adapters register {GLOBEX}")
    shot(page, "ops-adapters")

    # Acme's admin sees none of Globex's, in the console or from the API.
    actx = context(browser)
    acme = actx.new_page()
    acme.goto(link("tenant-admin", ACME))
    expect(acme.get_by_test_id("who")).to_contain_text(ACME)
    expect(acme.get_by_test_id("no-adapters")).to_be_visible()
    expect(acme.locator(f'[data-adapter="{ref}"]')).to_have_count(0)
    acme_admin = token("tenant-admin", ACME)
    status, body = http("GET", f"{URL}/v1/tenants/{ACME}/adapters", acme_admin)
    assert status == 200 and body["data"] == [], (status, body)
    status, body = http("GET", f"{URL}/v1/tenants/{GLOBEX}/adapters", acme_admin)
    assert status == 403, (status, body)

    # Globex's admin sees its own and shares it; naming itself is refused beside the field.
    gctx = context(browser)
    globex = gctx.new_page()
    globex.goto(link("tenant-admin", GLOBEX))
    expect(globex.get_by_test_id("who")).to_contain_text(GLOBEX)
    expect(adapter_rows(globex, ref)).to_have_count(2)
    form = globex.locator(f'[data-testid=adapter-sharing][data-adapter="{ref}"]')
    form.locator("input[name=shared_with]").fill(GLOBEX)
    form.get_by_role("button", name="Save sharing").click()
    confirm(globex)
    expect(globex.get_by_test_id("error")).to_contain_text("400")
    expect(form.locator('[data-error-for="shared_with"]')).to_contain_text("its own tenant's already")
    form.locator("input[name=shared_with]").fill(f" {ACME} ")
    form.get_by_role("button", name="Save sharing").click()
    confirm(globex)
    expect(globex.get_by_test_id("notice")).to_contain_text(f"{ref} is shared with {ACME}")
    expect(adapter_rows(globex, ref).locator("[data-field=shared-with]")).to_have_text([ACME, ACME])
    gctx.close()

    # Now Acme's admin sees it, as shared by Globex, with nothing to change.
    acme.reload()
    shared = adapter_rows(acme, ref)
    expect(shared).to_have_count(2)
    expect(shared.locator("[data-field=source]")).to_have_text([f"shared by {GLOBEX}"] * 2)
    expect(shared.first).to_have_attribute("data-shared-by", GLOBEX)
    expect(shared.get_by_role("button")).to_have_count(0)
    expect(acme.get_by_test_id("adapter-sharing")).to_have_count(0)
    shot(acme, "tenant-admin-shared-adapter")

    # The records explorer's adapter filter, kept in the URL: one revision exactly, or every
    # revision of the name; never the bare request, nor a name's prefix.
    auditor = token("auditor")
    records = wait_records(auditor, GLOBEX, 4)
    assert sorted(str(r["adapter"]) for r in records) == sorted(
        [f"{ref}@{new}", f"{ref}@{new}", f"{ref}@{old}", "None"]), [r["adapter"] for r in records]
    rctx = context(browser)
    rec = rctx.new_page()
    rec.goto(link("auditor"))
    expect(rec.get_by_test_id("who")).to_contain_text("auditor")
    filters = rec.get_by_test_id("record-filters")
    rows = rec.locator("[data-testid=records] tbody tr")
    for adapter, want in [(f"{ref}@{old}", [old]), (ref, [new, new, old]), ("", [])]:
        filters.get_by_label("Tenant").fill(GLOBEX)
        filters.get_by_label("Adapter", exact=True).fill(adapter)
        filters.get_by_role("button", name="Apply filters").click()
        expect(rows).to_have_count(len(want) or 4)
        assert hash_query(rec).get("adapter") == ([adapter] if adapter else None), rec.url
        cells = rec.locator("[data-testid=records] tbody td[data-adapter]")
        expect(cells).to_have_count(len(want) if adapter else 3)
        if adapter:
            got = sorted(c.split("@")[1] for c in cells.evaluate_all("cs => cs.map((c) => c.dataset.adapter)"))
            assert got == sorted(want), (adapter, got)
        if adapter == f"{ref}@{old}":
            shot(rec, "auditor-records-adapter")
    rec.goto(f"{URL}/console#/records?" + urllib.parse.urlencode({"adapter": ref[:-1]}))
    expect(filters.get_by_label("Adapter", exact=True)).to_have_value(ref[:-1])
    expect(rows).to_have_count(0)
    rctx.close()

    # Retired in the console: the newest revision (the name rolls back to the older), then
    # the name; Acme's admin sees it retired too.
    page.reload()
    newest = page.locator(f'[data-testid=adapters] tbody tr[data-revision="{new}"]')
    newest.get_by_role("button", name="Retire").click()
    page.get_by_test_id("confirm").get_by_role("button", name="Cancel").click()
    expect(newest.locator("[data-field=status]")).to_have_text("active")
    newest.get_by_role("button", name="Retire").click()
    confirm(page)
    expect(page.get_by_test_id("notice")).to_contain_text("retired")
    expect(newest.locator("[data-field=status]")).to_have_text("retired")
    expect(newest.get_by_role("button")).to_have_count(0)
    older = page.locator(f'[data-testid=adapters] tbody tr[data-revision="{old}"]')
    expect(older.locator("[data-field=status]")).to_have_text("active")
    page.get_by_test_id("retire-adapter").click()
    confirm(page)
    expect(page.get_by_test_id("notice")).to_contain_text(f"Every revision of {ref} retired")
    expect(adapter_rows(page, ref).locator("[data-field=status]")).to_have_text(["retired", "retired"])
    expect(page.get_by_test_id("retire-adapter")).to_have_count(0)
    shot(page, "ops-adapters-retired")
    acme.reload()
    expect(adapter_rows(acme, ref).locator("[data-field=status]")).to_have_text(["retired", "retired"])
    actx.close()
    status, log = http("GET", f"{URL}/v1/audit-log?limit=1000", ops)
    assert status == 200, (status, log)
    actions = [(e["action"], e["target"]) for e in log["data"] if e["target"].startswith(f"adapter:{ref}")]
    for want in [("adapter.register", f"adapter:{ref}@{old}"), ("adapter.register", f"adapter:{ref}@{new}"),
                 ("adapter.share", f"adapter:{ref}"), ("adapter.retire", f"adapter:{ref}@{new}"),
                 ("adapter.retire", f"adapter:{ref}@{old}")]:
        assert want in actions, (want, actions)
    ctx.close()


def sign_in_and_themes(browser):
    for scheme in ["light", "dark"]:
        ctx = context(browser, color_scheme=scheme)
        page = ctx.new_page()
        page.goto(f"{URL}/console")
        expect(page.get_by_test_id("login")).to_be_visible()
        page.get_by_label("Token").fill("not-a-token")
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_test_id("error")).to_contain_text("401")
        page.get_by_label("Token").fill(token("ops"))
        page.keyboard.press("Tab")
        page.keyboard.press("Enter")
        expect(page.get_by_test_id("who")).to_contain_text("ops")
        expect(page.locator(f'[data-tenant="{ACME}"]')).to_be_visible()
        bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
        fg = page.evaluate("getComputedStyle(document.body).color")
        assert bg != fg, (bg, fg)
        dark = sum(int(x) for x in bg[bg.index("(") + 1:bg.index(")")].split(",")[:3]) < 200
        assert dark == (scheme == "dark"), f"{scheme} theme has background {bg}"
        shot(page, f"ops-tenants-{scheme}")
        ctx.close()


def main():
    os.makedirs(SHOTS, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ["CHROMIUM"], args=ARGS)
        try:
            secret = ops_flow(browser)
            auditor_flow(browser)
            tenant_admin_flow(browser, secret)
            billing_flow(browser)
            adapter_flow(browser)
            sign_in_and_themes(browser)
        finally:
            browser.close()
        assert not EXTERNAL, f"the console loaded from elsewhere: {EXTERNAL}"
    print("console flow passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        raise
