// The Sluice console: one page over the billing service's API, its views chosen by the
// token's role (`GET /v1/whoami`). The API decides every call; a refusal is shown as a
// message, never as a blank page. The token is read from the link's fragment once, then kept
// in this tab's sessionStorage only, and never written into a URL.
'use strict';
(() => {
  const TOKEN_KEY = 'sluice.token'; // shared with the dashboard, in this tab only
  const EXPORT_PAGE = 1000;
  const SCOPES = ['completions', 'chat', 'models'];
  const FINISH_REASONS = ['stop', 'length', 'tool_calls', 'content_filter', 'abort', 'client_disconnected', 'timeout', 'error', 'rejected'];
  const QUOTA_FIELDS = [
    ['rpm', 'Requests per minute'], ['tpm', 'Tokens per minute'], ['daily_tokens', 'Tokens per day'],
    ['monthly_tokens', 'Tokens per month'], ['concurrency', 'Requests in flight'],
    ['max_prompt_tokens', 'Longest prompt (tokens)'], ['max_output_tokens', 'Largest max_tokens'],
    ['max_n', 'Largest n'], ['priority', 'Scheduling priority'],
  ];
  const RECORD_FILTERS = [
    ['tenant', 'Tenant'], ['key', 'Key id'], ['model', 'Model'], ['model_revision', 'Model revision'],
    ['finish_reason', 'Finish reason'], ['status', 'HTTP status'], ['adapter', 'Adapter'], ['since', 'Since'], ['until', 'Until'],
  ];
  const RECORD_PLACEHOLDERS = {
    since: '24h, 2026-12-01 or RFC 3339', until: '24h, 2026-12-01 or RFC 3339',
    adapter: 'tenant/name or tenant/name@sha256:…',
  };
  const RECORD_COLUMNS = [
    ['arrival_at', 'Arrival (UTC)'], ['request_id', 'Request'], ['tenant_id', 'Tenant'], ['model_id', 'Model'],
    ['adapter', 'Adapter'], ['finish_reason', 'Finish'], ['http_status', 'Status'], ['prompt_tokens', 'Prompt', 'num'],
    ['completion_tokens', 'Output', 'num'], ['cost_micros', 'Cost (µ$)', 'num'], ['ttft_ms', 'TTFT ms', 'num'],
  ];

  const $ = (id) => document.getElementById(id);
  let token = null;
  let me = null; // {actor, role, tenant}

  // ---------- DOM (text only through textContent: nothing from the API is parsed as HTML) ----------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'text') node.textContent = v;
      else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? '' : String(v));
    }
    node.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
    return node;
  }
  const shown = (v) => (v === null || v === undefined || v === '' ? '–' : String(v));
  /** `sha256:` and its first 12 hex digits: enough to tell revisions apart in a table. */
  const shortRevision = (r) => (/^sha256:[0-9a-f]{13,}$/.test(r) ? `${r.slice(0, 19)}…` : r);
  /** `tenant/name@sha256:…` with its revision shortened. */
  const shortAdapter = (id) => {
    const at = id.indexOf('@');
    return at < 0 ? id : `${id.slice(0, at + 1)}${shortRevision(id.slice(at + 1))}`;
  };
  const card = (title, ...children) => el('section', { class: 'card' }, el('h2', { text: title }), ...children);
  function table(testid, heads, rows) {
    return el('div', { class: 'table-scroll' }, el('table', { 'data-testid': testid },
      el('thead', {}, el('tr', {}, heads.map(([text, cls]) => el('th', { text, class: cls, scope: 'col' })))),
      el('tbody', {}, rows)));
  }
  function field(label, input, errorFor) {
    return el('label', { class: 'field' }, label, input,
      errorFor ? el('span', { class: 'field-error', 'data-error-for': errorFor, 'aria-live': 'polite' }) : null);
  }

  // ---------- messages ----------
  function showError(title, message) {
    $('error').replaceChildren(el('strong', { text: title }), el('span', { text: message }));
    $('error').hidden = false;
  }
  function notice(message) {
    $('notice').textContent = message;
    $('notice').hidden = false;
  }
  function clearMessages() {
    $('error').hidden = true;
    $('notice').hidden = true;
    for (const e of document.querySelectorAll('[data-error-for]')) e.textContent = '';
    for (const i of document.querySelectorAll('[aria-invalid]')) i.removeAttribute('aria-invalid');
  }
  /** An API refusal: the message, and beside the form field it names when there is one. */
  function report(e, form) {
    if (!(e instanceof ApiError)) { showError('Something went wrong', String(e.message || e)); return; }
    const titles = {
      400: 'The service refused this (400)', 401: 'Not signed in (401): the token was refused',
      403: 'Access denied (403)', 404: 'Not found (404)', 409: 'Conflict (409)',
    };
    showError(titles[e.status] || `The billing service answered ${e.status}`, e.message);
    if (form && e.param) {
      // An item of a list (`shared_with[1]`) is shown beside the list's field.
      const slot = [...new Set([e.param, e.param.replace(/\[\d+\].*$/, '')])]
        .map((p) => form.querySelector(`[data-error-for="${CSS.escape(p)}"]`)).find(Boolean);
      if (slot) {
        slot.textContent = e.message;
        const input = form.querySelector(`[name="${CSS.escape(slot.dataset.errorFor)}"]`);
        if (input) { input.setAttribute('aria-invalid', 'true'); input.focus(); }
      }
    }
    if (e.status === 401) { forgetToken(); showLogin(); }
  }

  /** Asks before a change; resolves true on Confirm. Escape or Cancel declines. */
  function confirmChange(title, text) {
    const dialog = $('confirm');
    $('confirm-title').textContent = title;
    $('confirm-text').textContent = text;
    return new Promise((resolve) => {
      const done = (answer) => {
        $('confirm-ok').onclick = null;
        $('confirm-cancel').onclick = null;
        dialog.onclose = null;
        if (dialog.open) dialog.close();
        resolve(answer);
      };
      $('confirm-ok').onclick = () => done(true);
      $('confirm-cancel').onclick = () => done(false);
      dialog.onclose = () => done(false);
      dialog.showModal();
      $('confirm-ok').focus();
    });
  }

  // ---------- the API ----------
  class ApiError extends Error {
    constructor(status, message, param) { super(message); this.status = status; this.param = param; }
  }
  async function api(method, path, { query, body, text } = {}) {
    const qs = query ? new URLSearchParams(Object.entries(query).filter(([, v]) => v !== '' && v !== null && v !== undefined)) : null;
    const url = path + (qs && String(qs) ? `?${qs}` : '');
    const headers = { Authorization: `Bearer ${token}`, Accept: 'application/json' };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    let res;
    try {
      res = await fetch(url, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), cache: 'no-store' });
    } catch (e) {
      throw new ApiError(0, `could not reach the billing service: ${e.message || e}`);
    }
    const raw = await res.text();
    if (!res.ok) {
      let message = raw.trim() || res.statusText;
      let param = null;
      try {
        const err = JSON.parse(raw).error;
        if (err && err.message) { message = err.message; param = err.param || null; }
      } catch (_) { /* not JSON: the text itself */ }
      throw new ApiError(res.status, message, param);
    }
    if (text) return { text: raw, next: res.headers.get('x-next-cursor') };
    try { return JSON.parse(raw); } catch (_) { throw new ApiError(res.status, 'the billing service did not return JSON'); }
  }

  // ---------- token ----------
  function readToken() {
    const frag = new URLSearchParams(location.hash.replace(/^#/, ''));
    const fromLink = frag.get('token');
    if (fromLink) {
      try { sessionStorage.setItem(TOKEN_KEY, fromLink); } catch (_) { /* storage off: memory only */ }
      history.replaceState(null, '', `${location.pathname}#/`);
      return fromLink;
    }
    try { return sessionStorage.getItem(TOKEN_KEY); } catch (_) { return null; }
  }
  function forgetToken() {
    token = null;
    me = null;
    try { sessionStorage.removeItem(TOKEN_KEY); } catch (_) { /* nothing stored */ }
  }
  function showLogin() {
    $('login').hidden = false;
    $('view').replaceChildren();
    $('nav').replaceChildren();
    $('who').textContent = '';
    $('signout').hidden = true;
    document.body.dataset.state = 'login';
    $('token-input').focus();
  }

  // ---------- routing: #/view?filters (never the token) ----------
  const VIEWS = {
    tenants: { title: 'Tenants', roles: ['ops'], render: tenantsView },
    tenant: { title: 'Tenant', roles: ['ops', 'tenant-admin'], render: tenantView, hidden: true },
    'my-tenant': { title: 'My tenant', roles: ['tenant-admin'], render: () => tenantView(me.tenant) },
    records: { title: 'Records', roles: ['auditor'], render: recordsView },
    'audit-log': { title: 'Audit log', roles: ['auditor', 'ops'], render: auditLogView },
    reconcile: { title: 'Reconciliation', roles: ['auditor', 'billing'], render: reconcileView },
    billing: { title: 'Dashboard', roles: ['billing'], render: billingView },
  };
  const HOME = { ops: 'tenants', auditor: 'records', billing: 'billing', 'tenant-admin': 'my-tenant' };

  function route() {
    const [path, qs] = location.hash.replace(/^#\/?/, '').split('?');
    const [name, ...rest] = path.split('/');
    return { name: name || HOME[me.role] || 'tenants', arg: rest.map(decodeURIComponent).join('/'), params: new URLSearchParams(qs || '') };
  }
  let pending = null; // a message to show once the next view is drawn
  /** Shows view `hash`, then `message` when given. */
  async function go(hash, message) {
    pending = message || null;
    if (location.hash !== hash) { location.hash = hash; return; } // the hashchange draws it
    clearMessages();
    await render();
    flush();
  }
  function flush() { if (pending) notice(pending); pending = null; }

  function renderNav(current) {
    $('nav').replaceChildren(...Object.entries(VIEWS)
      .filter(([, v]) => !v.hidden && v.roles.includes(me.role))
      .map(([name, v]) => el('a', { href: `#/${name}`, 'aria-current': name === current ? 'page' : null, text: v.title })));
  }

  let drawing = 0; // the latest render's number: an older one still loading draws nothing
  async function render() {
    if (!me) return;
    const mine = ++drawing;
    const r = route();
    renderNav(r.name);
    const view = VIEWS[r.name];
    const box = $('view');
    document.body.dataset.state = 'loading';
    box.replaceChildren();
    if (!view) {
      showError('Not found', `there is no view ${r.name}`);
      document.body.dataset.state = 'ready';
      return;
    }
    if (!view.roles.includes(me.role)) {
      // The API would refuse it too; say so rather than show an empty page.
      showError('Access denied (403)', `the ${view.title} view is for ${view.roles.join(' or ')}; this token's role is ${me.role}`);
      box.append(el('p', { class: 'note', text: 'Choose a view above.' }));
      document.body.dataset.state = 'denied';
      return;
    }
    try {
      const content = [await view.render(r.arg, r.params)].flat();
      // Two renders overlapping (a sign-in's and a hashchange's) would both append: only
      // the latest draws.
      if (mine !== drawing) return;
      box.append(...content);
      document.body.dataset.state = 'ready';
    } catch (e) {
      if (mine !== drawing) return;
      report(e);
      document.body.dataset.state = 'error';
    }
  }

  // ---------- ops: tenants ----------
  async function tenantsView() {
    const [tenants, tiers] = await Promise.all([api('GET', '/v1/tenants'), api('GET', '/v1/tiers')]);
    const form = el('form', { 'data-testid': 'create-tenant', novalidate: true });
    const tierSelect = el('select', { name: 'tier' }, tiers.data.map((t) => el('option', { value: t.name, text: t.name, selected: t.name === 'standard' })));
    form.append(el('div', { class: 'row' },
      field('Tenant id', el('input', { name: 'id', required: true, pattern: '[a-z0-9_-]{1,64}', autocomplete: 'off' }), 'id'),
      field('Display name', el('input', { name: 'name', autocomplete: 'off' }), 'name'),
      field('Tier', tierSelect, 'tier'),
      el('button', { class: 'primary', type: 'submit', text: 'Create tenant' })));
    form.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      clearMessages();
      const id = form.elements.id.value.trim();
      const name = form.elements.name.value.trim();
      const tier = form.elements.tier.value;
      if (!(await confirmChange('Create tenant', `Create tenant ${id || '(no id)'} on the ${tier} tier?`))) return;
      try {
        await api('POST', '/v1/tenants', { body: { id, name: name || null, tier } });
        await go(`#/tenant/${encodeURIComponent(id)}`, `Tenant ${id} created.`);
      } catch (e) { report(e, form); }
    });
    const rows = tenants.data.map((t) => el('tr', { 'data-tenant': t.id },
      el('td', {}, el('a', { href: `#/tenant/${encodeURIComponent(t.id)}`, text: t.id })),
      el('td', { text: t.name }), el('td', { text: t.tier }),
      el('td', { class: `status-${t.status}`, text: t.status }), el('td', { text: t.created_at })));
    return [
      card('New tenant', form),
      card(`Tenants (${tenants.data.length})`, table('tenants', [['Id'], ['Name'], ['Tier'], ['Status'], ['Created (UTC)']], rows)),
    ];
  }

  // ---------- ops and tenant-admin: one tenant ----------
  async function tenantView(id) {
    if (!id) throw new ApiError(404, 'no tenant named');
    const ops = me.role === 'ops';
    const [tenant, keys, quota, adapters] = await Promise.all([
      api('GET', `/v1/tenants/${encodeURIComponent(id)}`),
      api('GET', `/v1/tenants/${encodeURIComponent(id)}/keys`),
      api('GET', `/v1/tenants/${encodeURIComponent(id)}/quota`),
      api('GET', `/v1/tenants/${encodeURIComponent(id)}/adapters`),
    ]);
    const out = [summaryCard(tenant, ops), keysCard(tenant, keys.data), quotaCard(tenant, quota, ops), adaptersCard(tenant, adapters.data)];
    if (me.role === 'tenant-admin') out.push(await usageCard(tenant.id));
    return out;
  }

  function summaryCard(t, ops) {
    const body = [el('dl', { class: 'detail', 'data-testid': 'tenant-summary' },
      el('dt', { text: 'Id' }), el('dd', { text: t.id }), el('dt', { text: 'Name' }), el('dd', { text: t.name }),
      el('dt', { text: 'Tier' }), el('dd', { 'data-testid': 'tenant-tier', text: t.tier }),
      el('dt', { text: 'Status' }), el('dd', { class: `status-${t.status}`, 'data-testid': 'tenant-status', text: t.status }),
      el('dt', { text: 'Created' }), el('dd', { text: t.created_at }))];
    if (ops) {
      const form = el('form', { class: 'row', 'data-testid': 'change-tier', novalidate: true });
      const tiers = el('select', { name: 'tier' });
      api('GET', '/v1/tiers').then((r) => tiers.append(...r.data.map((x) => el('option', { value: x.name, text: x.name, selected: x.name === t.tier })))).catch((e) => report(e));
      form.append(field('Tier', tiers, 'tier'), el('button', { type: 'submit', text: 'Change tier' }));
      form.addEventListener('submit', (ev) => {
        ev.preventDefault();
        change(form, `Change tier of ${t.id}`, `Move ${t.id} from ${t.tier} to ${tiers.value}?`, 'PATCH', `/v1/tenants/${encodeURIComponent(t.id)}`, { tier: tiers.value }, `Tenant ${t.id} is now on the ${tiers.value} tier.`);
      });
      const suspend = t.status === 'active';
      const toggle = el('button', {
        type: 'button', 'data-testid': suspend ? 'suspend' : 'activate', text: suspend ? 'Suspend tenant' : 'Activate tenant',
        onclick: () => change(null, suspend ? 'Suspend tenant' : 'Activate tenant',
          suspend ? `Suspend ${t.id}? Its keys stop working at every gateway.` : `Activate ${t.id} again?`,
          'POST', `/v1/tenants/${encodeURIComponent(t.id)}/${suspend ? 'suspend' : 'activate'}`, undefined,
          `Tenant ${t.id} ${suspend ? 'suspended' : 'activated'}.`),
      });
      body.push(el('h3', { text: 'Change' }), form, el('p', {}, toggle));
    }
    return card(`Tenant ${t.id}`, ...body);
  }

  /** Confirms, sends, re-renders and says what happened; a refusal lands beside its field. */
  async function change(form, title, question, method, path, body, done) {
    clearMessages();
    if (!(await confirmChange(title, question))) return null;
    try {
      const r = await api(method, path, { body });
      await render();
      notice(done);
      return r;
    } catch (e) { report(e, form); return null; }
  }

  function keyStatus(k) {
    if (k.revoked_at) return 'revoked';
    if (k.expires_at && Date.parse(k.expires_at) <= Date.now()) return 'expired';
    return 'active';
  }

  function keysCard(t, keys) {
    const form = el('form', { 'data-testid': 'issue-key', novalidate: true });
    form.append(el('div', { class: 'row' },
      field('Expires (your local time; empty: never)', el('input', { type: 'datetime-local', name: 'expires_at' }), 'expires_at'),
      el('fieldset', { class: 'row' }, el('legend', { text: 'Scopes' }),
        SCOPES.map((s) => el('label', {}, el('input', { type: 'checkbox', name: 'scope', value: s, checked: true }), ` ${s}`))),
      el('button', { class: 'primary', type: 'submit', text: 'Issue key' })),
    el('span', { class: 'field-error', 'data-error-for': 'scopes' }));
    const secretBox = el('div', { 'data-testid': 'new-secret', hidden: true });
    form.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      clearMessages();
      const scopes = [...form.querySelectorAll('input[name="scope"]:checked')].map((i) => i.value);
      const local = form.elements.expires_at.value;
      const expires = local ? new Date(local) : null;
      if (expires && !Number.isFinite(expires.getTime())) { showError('Invalid expiry', 'the expiry is not a date and time'); return; }
      const body = { scopes };
      if (expires) body.expires_at = expires.toISOString();
      const when = expires ? `expiring ${body.expires_at}` : 'that never expires';
      if (!(await confirmChange('Issue key', `Issue a key for ${t.id} (${scopes.join(', ') || 'no scopes'}) ${when}?`))) return;
      let key;
      try { key = await api('POST', `/v1/tenants/${encodeURIComponent(t.id)}/keys`, { body }); } catch (e) { report(e, form); return; }
      await render();
      notice(`Key ${key.prefix} issued for ${t.id}.`);
      showSecret(key);
    });
    const filter = el('input', { type: 'search', placeholder: 'sk-…', 'aria-label': 'Filter keys by prefix', 'data-testid': 'key-filter' });
    const rows = keys.map((k) => {
      const status = keyStatus(k);
      return el('tr', { 'data-prefix': k.prefix, 'data-key': k.id },
        el('td', { class: 'mono', text: k.prefix }), el('td', { class: 'mono', text: k.id }),
        el('td', { text: k.scopes.join(', ') }), el('td', { text: k.created_at }), el('td', { text: shown(k.expires_at) }),
        el('td', { class: `status-${status}`, text: status }),
        el('td', {}, status === 'revoked' ? null : el('button', {
          type: 'button', text: 'Revoke', 'aria-label': `Revoke key ${k.prefix}`,
          onclick: () => change(null, 'Revoke key', `Revoke key ${k.prefix} of ${t.id}? Requests with it are refused from now on.`,
            'POST', `/v1/tenants/${encodeURIComponent(t.id)}/keys/${encodeURIComponent(k.id)}/revoke`, undefined, `Key ${k.prefix} revoked.`),
        })));
    });
    filter.addEventListener('input', () => {
      const p = filter.value.trim();
      for (const r of rows) r.hidden = p !== '' && !r.dataset.prefix.startsWith(p);
    });
    return card(`Keys (${keys.length})`, form, secretBox,
      el('h3', { text: 'Issued keys' }), el('p', {}, field('Prefix', filter)),
      table('keys', [['Prefix'], ['Id'], ['Scopes'], ['Issued (UTC)'], ['Expires (UTC)'], ['Status'], ['']], rows));
  }

  /** The new key's secret, this once: the service keeps only its hash. */
  function showSecret(key) {
    const box = document.querySelector('[data-testid="new-secret"]');
    if (!box) return;
    const code = el('code', { 'data-testid': 'secret', text: key.secret });
    const status = el('span', { 'aria-live': 'polite', 'data-testid': 'copy-status' });
    const copy = el('button', {
      type: 'button', class: 'primary', text: 'Copy', 'data-testid': 'copy-secret',
      onclick: async () => {
        try { await navigator.clipboard.writeText(key.secret); status.textContent = 'Copied.'; } catch (_) {
          const range = document.createRange();
          range.selectNodeContents(code);
          getSelection().removeAllRanges();
          getSelection().addRange(range);
          status.textContent = 'Selected: press Ctrl+C to copy.';
        }
      },
    });
    const forget = el('button', { type: 'button', text: 'I have stored it', onclick: () => { box.replaceChildren(); box.hidden = true; } });
    box.replaceChildren(el('div', { class: 'ok' },
      el('strong', { text: `Secret of key ${key.prefix}: shown this once, it cannot be read again.` }),
      el('div', { class: 'secret' }, code, copy, forget, status)));
    box.hidden = false;
    copy.focus();
  }

  function quotaCard(t, q, ops) {
    const val = (o, f) => (o ? o[f] : null);
    const models = (o) => (o && o.allowed_models && o.allowed_models.length ? o.allowed_models.join(', ') : null);
    const rows = QUOTA_FIELDS.map(([f, label]) => el('tr', { 'data-field': f },
      el('th', { scope: 'row', text: label }), el('td', { class: 'num', text: shown(val(q.tier_settings, f)) }),
      el('td', { class: 'num', text: shown(val(q.overrides, f)) }),
      el('td', { class: 'num', 'data-testid': `effective-${f}`, text: shown(val(q.effective, f)) })));
    rows.push(el('tr', { 'data-field': 'allowed_models' }, el('th', { scope: 'row', text: 'Allowed models' }),
      el('td', { text: models(q.tier_settings) || 'every model' }), el('td', { text: shown(models(q.overrides)) }),
      el('td', { 'data-testid': 'effective-allowed_models', text: models(q.effective) || 'every model' })));
    const body = [
      el('p', { class: 'note', text: 'The tier\'s values, the tenant\'s overrides, and what gateways enforce (–: no limit). A key\'s own limits apply beside these.' }),
      table('quota', [['Limit'], ['Tier ' + q.tier, 'num'], ['Override', 'num'], ['Effective', 'num']], rows),
    ];
    if (ops) {
      const form = el('form', { 'data-testid': 'edit-quota', novalidate: true });
      form.append(el('p', { class: 'note', text: 'Leave a field empty to take the tier\'s value. Saving replaces every override.' }),
        el('div', { class: 'row' },
          QUOTA_FIELDS.map(([f, label]) => field(label, el('input', { type: 'number', name: f, step: 1, value: val(q.overrides, f) ?? '' }), f)),
          field('Allowed models (comma separated; empty: the tier\'s)', el('input', { name: 'allowed_models', value: models(q.overrides) || '' }), 'allowed_models')),
        el('p', {}, el('button', { class: 'primary', type: 'submit', text: 'Save quota' })));
      form.addEventListener('submit', (ev) => {
        ev.preventDefault();
        const body = {};
        for (const [f] of QUOTA_FIELDS) {
          const raw = form.elements[f].value.trim();
          if (raw === '') continue;
          const n = Number(raw);
          if (!Number.isInteger(n)) {
            clearMessages();
            report(new ApiError(400, `${f} must be a whole number`, f), form);
            return;
          }
          body[f] = n;
        }
        body.allowed_models = form.elements.allowed_models.value.split(',').map((s) => s.trim()).filter(Boolean);
        const summary = Object.entries(body).filter(([k]) => k !== 'allowed_models').map(([k, v]) => `${k}=${v}`).join(', ');
        change(form, `Set quota of ${t.id}`, `Replace ${t.id}'s overrides with: ${summary || 'none (the tier\'s values)'}?`,
          'PUT', `/v1/tenants/${encodeURIComponent(t.id)}/quota`, body, `Quota of ${t.id} saved.`);
      });
      body.push(el('h3', { text: 'Edit overrides' }), form);
    }
    return card('Quota', ...body);
  }

  /**
   * The tenant's adapters (every revision, newest first within a name) and those other tenants
   * share with it; its own can be shared and retired here. Registration is the CLI's: it checks
   * the files against the base model and stores them where the engines read them.
   */
  function adaptersCard(t, adapters) {
    const tid = encodeURIComponent(t.id);
    const rows = adapters.map((a) => {
      const own = a.tenant_id === t.id;
      const ref = `${a.tenant_id}/${a.name}`;
      const retire = own && a.status === 'active' ? el('button', {
        type: 'button', text: 'Retire', 'data-testid': 'retire-revision', 'aria-label': `Retire revision ${shortRevision(a.revision)} of ${ref}`,
        onclick: () => change(null, 'Retire adapter revision',
          `Retire revision ${a.revision} of ${ref}? Running requests finish; new ones naming it are refused, and ${ref} alone runs the newest revision still active.`,
          'POST', `/v1/tenants/${tid}/adapters/${encodeURIComponent(a.name)}/retire`, { revision: a.revision },
          `Revision ${shortRevision(a.revision)} of ${ref} retired.`),
      }) : null;
      return el('tr', { 'data-adapter': ref, 'data-revision': a.revision, 'data-status': a.status, 'data-shared-by': own ? null : a.tenant_id },
        el('td', { class: 'mono', text: ref }),
        el('td', { class: 'mono', title: a.revision, text: shortRevision(a.revision) }),
        el('td', { 'data-field': 'base-model', text: a.base_model }), el('td', { class: 'num', 'data-field': 'rank', text: a.rank }),
        el('td', { class: `status-${a.status}`, 'data-field': 'status', text: a.status }),
        el('td', { text: a.created_at }),
        el('td', { 'data-field': 'shared-with', text: own ? shown(a.shared_with.join(', ')) : '–' }),
        el('td', { 'data-field': 'source', text: own ? 'own' : `shared by ${a.tenant_id}` }),
        el('td', {}, retire));
    });
    const names = [...new Set(adapters.filter((a) => a.tenant_id === t.id).map((a) => a.name))];
    const forms = names.map((name) => {
      const revisions = adapters.filter((a) => a.tenant_id === t.id && a.name === name);
      const ref = `${t.id}/${name}`;
      const path = `/v1/tenants/${tid}/adapters/${encodeURIComponent(name)}`;
      const form = el('form', { class: 'row', 'data-testid': 'adapter-sharing', 'data-adapter': ref, novalidate: true },
        field(`Tenants that may use ${ref} (comma separated; empty: only ${t.id})`,
          el('input', { name: 'shared_with', value: revisions[0].shared_with.join(', '), autocomplete: 'off' }), 'shared_with'),
        el('button', { type: 'submit', text: 'Save sharing' }),
        revisions.some((a) => a.status === 'active') ? el('button', {
          type: 'button', text: 'Retire every revision', 'data-testid': 'retire-adapter', 'aria-label': `Retire every revision of ${ref}`,
          onclick: () => change(form, 'Retire adapter', `Retire every active revision of ${ref}? Running requests finish; new ones naming it are refused.`,
            'POST', `${path}/retire`, {}, `Every revision of ${ref} retired.`),
        }) : null);
      form.addEventListener('submit', (ev) => {
        ev.preventDefault();
        const others = form.elements.shared_with.value.split(',').map((s) => s.trim()).filter(Boolean);
        change(form, `Share ${ref}`,
          others.length ? `Let ${others.join(', ')} use ${ref} (every revision), and no other tenant?` : `Stop sharing ${ref}: only ${t.id} may use it?`,
          'PUT', `${path}/sharing`, { shared_with: others },
          others.length ? `${ref} is shared with ${others.join(', ')}.` : `${ref} is no longer shared.`);
      });
      return form;
    });
    return card(`Adapters (${adapters.length})`,
      el('p', { class: 'note', 'data-testid': 'adapter-register-note' },
        'Registering a revision checks its files against the base model and puts them in the engines\' store, so it is done with ',
        el('code', { text: `sluice admin adapters register ${t.id} NAME --path DIR --model MODEL` }),
        '. Requests name an adapter as tenant/name (its newest active revision) or tenant/name@revision.'),
      adapters.length
        ? table('adapters', [['Adapter'], ['Revision'], ['Base model'], ['Rank', 'num'], ['Status'], ['Registered (UTC)'], ['Shared with'], ['Source'], ['']], rows)
        : el('p', { class: 'note', 'data-testid': 'no-adapters', text: 'No adapters of this tenant or shared with it.' }),
      forms.length ? el('h3', { text: 'Sharing and retirement' }) : null, forms);
  }

  async function usageCard(tenant) {
    const u = await api('GET', '/v1/usage', { query: { tenant, period: 'day', since: '30d' } });
    const rows = u.data.map((r) => el('tr', {},
      el('td', { text: r.bucket_start }), el('td', { text: r.model_id }), el('td', { class: 'num', text: r.requests }),
      el('td', { class: 'num', text: r.prompt_tokens }), el('td', { class: 'num', text: r.completion_tokens }),
      el('td', { class: 'num', text: r.cost_micros }), el('td', { class: 'num', text: r.refused_requests })));
    const tot = u.totals;
    return card('Usage, last 30 days',
      el('p', { 'data-testid': 'usage-totals', text: `${tot.requests} requests, ${tot.prompt_tokens} prompt and ${tot.completion_tokens} output tokens, ${tot.cost_micros} micro-dollars; ${tot.refused_requests} refused (free).` }),
      table('usage', [['Day (UTC)'], ['Model'], ['Requests', 'num'], ['Prompt', 'num'], ['Output', 'num'], ['Cost (µ$)', 'num'], ['Refused', 'num']], rows));
  }

  // ---------- auditor: records ----------
  function recordQuery(params) {
    const q = {};
    for (const [f] of RECORD_FILTERS) if (params.get(f)) q[f] = params.get(f);
    return q;
  }

  async function recordsView(_, params) {
    const asked = Number(params.get('limit'));
    const size = String(Number.isInteger(asked) && asked >= 1 && asked <= 1000 ? asked : 25);
    const sizes = [...new Set(['25', '100', '500', size])];
    const form = el('form', { 'data-testid': 'record-filters', novalidate: true });
    const reasons = el('datalist', { id: 'finish-reasons' }, FINISH_REASONS.map((r) => el('option', { value: r })));
    form.append(reasons, el('div', { class: 'row' },
      RECORD_FILTERS.map(([f, label]) => field(label, el('input', {
        name: f, value: params.get(f) || '', autocomplete: 'off', list: f === 'finish_reason' ? 'finish-reasons' : null,
        placeholder: RECORD_PLACEHOLDERS[f] || null,
      }), f)),
      field('Per page', el('select', { name: 'limit' }, sizes.map((n) => el('option', { value: n, text: n, selected: n === size })))),
      el('button', { class: 'primary', type: 'submit', text: 'Apply filters' }),
      el('button', { type: 'button', text: 'Clear', onclick: () => go('#/records') })));
    form.addEventListener('submit', (ev) => {
      ev.preventDefault();
      const q = new URLSearchParams();
      for (const [f] of RECORD_FILTERS) { const v = form.elements[f].value.trim(); if (v) q.set(f, v); }
      if (form.elements.limit.value !== '25') q.set('limit', form.elements.limit.value);
      go(`#/records?${q}`);
    });
    const filter = recordQuery(params);
    const cursor = params.get('cursor') || '';
    let page;
    try {
      page = await api('GET', '/v1/records', { query: { ...filter, limit: size, cursor, format: 'json' } });
    } catch (e) {
      report(e, form);
      return [card('Filters', form)];
    }
    const detail = el('div', { 'data-testid': 'record-detail', 'aria-live': 'polite' },
      el('p', { class: 'note', text: 'Choose a record to see its whole row.' }));
    const rows = page.records.map((r) => {
      const tr = el('tr', { class: 'pick', tabindex: 0, 'data-request': r.request_id },
        RECORD_COLUMNS.map(([f, , cls]) => (f === 'adapter' && r[f]
          ? el('td', { class: 'mono', title: r[f], 'data-adapter': r[f], text: shortAdapter(r[f]) })
          : el('td', { class: cls || (f === 'request_id' ? 'mono' : null), text: shown(r[f]) }))));
      const pick = () => {
        for (const o of rows) o.removeAttribute('aria-selected');
        tr.setAttribute('aria-selected', 'true');
        detail.replaceChildren(el('h3', { text: `Request ${r.request_id}` }),
          el('dl', { class: 'detail' }, Object.entries(r).flatMap(([k, v]) => [el('dt', { text: k }), el('dd', { 'data-field': k, text: shown(v) })])));
      };
      tr.addEventListener('click', pick);
      tr.addEventListener('keydown', (ev) => { if (ev.key === 'Enter' || ev.key === ' ') { ev.preventDefault(); pick(); } });
      return tr;
    });
    const here = new URLSearchParams(params);
    const back = params.getAll('back');
    const pager = el('div', { class: 'pager' });
    if (cursor) {
      const prev = new URLSearchParams(here);
      prev.delete('back');
      back.slice(0, -1).forEach((b) => prev.append('back', b));
      if (back.length && back[back.length - 1]) prev.set('cursor', back[back.length - 1]); else prev.delete('cursor');
      pager.append(el('a', { href: `#/records?${prev}`, 'data-testid': 'prev-page', text: '← Previous page' }));
    }
    if (page.next_cursor) {
      const next = new URLSearchParams(here);
      next.append('back', cursor);
      next.set('cursor', page.next_cursor);
      pager.append(el('a', { href: `#/records?${next}`, 'data-testid': 'next-page', text: 'Next page →' }));
    }
    const exportButtons = el('div', { class: 'row' },
      el('button', { type: 'button', 'data-testid': 'export-csv', text: 'Export CSV', onclick: () => exportRecords(filter, 'csv') }),
      el('button', { type: 'button', 'data-testid': 'export-jsonl', text: 'Export JSON Lines', onclick: () => exportRecords(filter, 'jsonl') }),
      el('span', { class: 'note', 'data-testid': 'export-status', 'aria-live': 'polite' }));
    return [
      card('Filters', form),
      card(`Records (${page.records.length} on this page${page.next_cursor ? ', more follow' : ''})`,
        el('p', { class: 'note', text: 'Oldest first. Export takes every record of the filter, not only this page.' }),
        exportButtons,
        table('records', RECORD_COLUMNS.map(([, h, cls]) => [h, cls]), rows), pager),
      card('Record', detail),
    ];
  }

  /** Every record of `filter`, page after page, as one download (what `sluice audit records` prints). */
  async function exportRecords(filter, format) {
    clearMessages();
    const status = document.querySelector('[data-testid="export-status"]');
    const parts = [];
    let cursor = '';
    let count = 0;
    try {
      for (;;) {
        const r = await api('GET', '/v1/records', { query: { ...filter, format, limit: EXPORT_PAGE, cursor }, text: true });
        let lines = r.text.split('\n').filter((l) => l !== '');
        if (format === 'csv') {
          const header = lines.shift();
          if (!parts.length && header !== undefined) parts.push(header + '\n');
        }
        for (const l of lines) parts.push(l + '\n');
        count += lines.length;
        if (status) status.textContent = `${count} records…`;
        if (!r.next || !lines.length) break;
        cursor = r.next;
      }
    } catch (e) { report(e); if (status) status.textContent = ''; return; }
    const type = format === 'csv' ? 'text/csv' : 'application/x-ndjson';
    const url = URL.createObjectURL(new Blob(parts, { type }));
    const stamp = new Date().toISOString().replace(/[:.]/g, '-');
    const a = el('a', { href: url, download: `sluice-records-${stamp}.${format}`, hidden: true });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
    if (status) status.textContent = `${count} records exported as ${format === 'csv' ? 'CSV' : 'JSON Lines'}.`;
  }

  // ---------- auditor and ops: the admin audit log ----------
  /** The leaves of a JSON value as dotted paths. */
  function leaves(v, prefix, out) {
    if (v && typeof v === 'object' && !Array.isArray(v)) {
      for (const [k, x] of Object.entries(v)) leaves(x, prefix ? `${prefix}.${k}` : k, out);
    } else if (prefix) {
      out.set(prefix, v === undefined ? null : v);
    }
    return out;
  }
  function diff(before, after) {
    const b = leaves(before, '', new Map());
    const a = leaves(after, '', new Map());
    const keys = [...new Set([...b.keys(), ...a.keys()])].sort();
    const text = (m, k) => (m.has(k) ? JSON.stringify(m.get(k)) : '');
    const changed = keys.filter((k) => text(b, k) !== text(a, k));
    if (!changed.length) return el('span', { class: 'note', text: 'no change' });
    return el('table', { class: 'diff' }, el('tbody', {}, changed.map((k) => el('tr', {},
      el('td', { class: 'mono', text: k }), el('td', { class: 'mono before', text: b.has(k) ? text(b, k) : '(none)' }),
      el('td', { 'aria-hidden': 'true', text: '→' }), el('td', { class: 'mono after', text: a.has(k) ? text(a, k) : '(none)' })))));
  }

  async function auditLogView(_, params) {
    const form = el('form', { 'data-testid': 'audit-filters', novalidate: true }, el('div', { class: 'row' },
      ['actor', 'target', 'since'].map((f) => field(f === 'target' ? 'Target (tenant:ID, key:ID)' : f[0].toUpperCase() + f.slice(1),
        el('input', { name: f, value: params.get(f) || '', autocomplete: 'off' }), f)),
      el('button', { class: 'primary', type: 'submit', text: 'Apply filters' })));
    form.addEventListener('submit', (ev) => {
      ev.preventDefault();
      const q = new URLSearchParams();
      for (const f of ['actor', 'target', 'since']) { const v = form.elements[f].value.trim(); if (v) q.set(f, v); }
      go(`#/audit-log?${q}`);
    });
    const query = { limit: 100 };
    for (const f of ['actor', 'target', 'since']) if (params.get(f)) query[f] = params.get(f);
    const tbody = el('tbody', {});
    const more = el('button', { type: 'button', text: 'Load more', hidden: true });
    const add = async (cursor) => {
      const page = await api('GET', '/v1/audit-log', { query: { ...query, cursor } });
      tbody.append(...page.data.map((e) => el('tr', { 'data-action': e.action, 'data-target': e.target },
        el('td', { text: e.at }), el('td', { text: e.actor }), el('td', { text: e.role }),
        el('td', { class: 'mono', text: e.action }), el('td', { class: 'mono', text: e.target }),
        el('td', {}, diff(e.before, e.after)))));
      more.hidden = !page.next_cursor;
      more.onclick = () => add(page.next_cursor).catch((err) => report(err));
    };
    try { await add(''); } catch (e) { report(e, form); return [card('Filters', form)]; }
    return [card('Filters', form), card('Admin audit log',
      el('p', { class: 'note', text: 'Every change to tenants, keys, quotas and adapters, oldest first, with what it changed.' }),
      el('div', { class: 'table-scroll' }, el('table', { 'data-testid': 'audit-log' },
        el('thead', {}, el('tr', {}, ['When (UTC)', 'Actor', 'Role', 'Action', 'Target', 'Changes'].map((h) => el('th', { scope: 'col', text: h })))),
        tbody)), el('p', {}, more))];
  }

  // ---------- auditor and billing: rollups against their rows ----------
  async function reconcileView(_, params) {
    const since = params.get('since') || '24h';
    const form = el('form', { class: 'row', novalidate: true },
      field('Since', el('input', { name: 'since', value: since }), 'since'),
      el('button', { class: 'primary', type: 'submit', text: 'Check' }));
    form.addEventListener('submit', (ev) => { ev.preventDefault(); go(`#/reconcile?${new URLSearchParams({ since: form.elements.since.value.trim() })}`); });
    let r;
    try { r = await api('GET', '/v1/audit/reconcile', { query: { since } }); } catch (e) { report(e, form); return [card('Reconciliation', form)]; }
    const sums = (s) => `${s.requests} req, ${s.prompt_tokens}+${s.completion_tokens} tok, ${s.cost_micros} µ$, ${s.refused_requests} refused`;
    const verdict = r.differences.length
      ? el('p', { class: 'alert', 'data-testid': 'reconcile-verdict', text: `${r.differences.length} of ${r.buckets} hour buckets differ from their rows.` })
      : el('p', { class: 'ok', 'data-testid': 'reconcile-verdict', text: `The rollups agree with their rows: ${r.records} records in ${r.buckets} hour buckets since ${r.since}.` });
    return [card('Reconciliation', el('p', { class: 'note', text: 'The hour rollups the dashboard and quotas read, recomputed from the request records.' }), form, verdict,
      r.differences.length ? table('differences', [['Hour'], ['Tenant'], ['Model'], ['Rows'], ['Rollup']],
        r.differences.map((d) => el('tr', {}, el('td', { text: d.bucket_start }), el('td', { text: d.tenant_id }),
          el('td', { text: d.model_id }), el('td', { text: sums(d.rows) }), el('td', { text: sums(d.rollup) })))) : null)];
  }

  function billingView() {
    return card('Billing dashboard',
      el('p', { class: 'note', text: 'Tokens, cost, finish reasons, latency and per-tenant SLO attainment over a window.' }),
      el('p', {}, el('a', { href: '/dashboard', 'data-testid': 'open-dashboard', text: 'Open the dashboard' })));
  }

  // ---------- start ----------
  async function signIn() {
    clearMessages();
    try {
      me = await api('GET', '/v1/whoami');
    } catch (e) {
      report(e);
      if (e.status !== 401) { forgetToken(); showLogin(); }
      return;
    }
    $('login').hidden = true;
    $('who').textContent = `${me.actor} · ${me.role}${me.tenant ? ` · ${me.tenant}` : ''}`;
    $('signout').hidden = false;
    await render();
  }

  $('login').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const value = $('token-input').value.trim();
    if (!value) return;
    token = value;
    $('token-input').value = '';
    try { sessionStorage.setItem(TOKEN_KEY, value); } catch (_) { /* memory only */ }
    signIn();
  });
  $('signout').addEventListener('click', () => { forgetToken(); clearMessages(); showLogin(); });
  window.addEventListener('hashchange', async () => { if (me) { clearMessages(); await render(); flush(); } });

  token = readToken();
  if (token) signIn(); else showLogin();
})();
