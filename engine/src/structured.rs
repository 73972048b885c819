//! Structured outputs: a JSON Schema (or "any JSON object") compiled to a [`Grammar`], and a
//! byte-level [`Matcher`] over it that says which tokens may come next, so every completion
//! of a constrained request parses and validates.
//!
//! The matcher is a set of pushdown stacks, one per live reading of the bytes so far (an
//! `anyOf`, a key among several, a literal among an enum's): a byte advances each stack or
//! ends it, and the bytes are accepted while one survives. Tokens are checked lazily by the
//! sampler ([`sample_constrained`]): the token it draws from the model's distribution is
//! kept when the grammar accepts its bytes, and only otherwise is the whole vocabulary
//! masked and the draw made again, so most steps cost one check.
//!
//! Objects are written in the schema's property order, every required property present and
//! optional ones skippable; whitespace between tokens is limited to a short run, so a small
//! model cannot fill its budget with it; numbers to 24 characters.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::Value;

use crate::sampler::{Sampled, Sampler};

/// Most consecutive whitespace bytes between JSON tokens.
const MAX_WS: u8 = 12;
/// Most bytes of one number.
const MAX_NUMBER: u8 = 24;
/// Most nested objects and arrays.
const MAX_DEPTH: usize = 32;
/// Most live readings at once; beyond, the newest are dropped (the output stays valid).
const MAX_STACKS: usize = 64;
/// Most levels a schema nests, counting `properties`, `items`, `anyOf` and `$ref` hops: the
/// compiler recurses once a level, so this bounds its stack whatever the schema.
pub const MAX_SCHEMA_DEPTH: usize = 64;
/// Most parts (objects, arrays, alternatives, literals, references) one grammar has.
pub const MAX_NODES: usize = 4096;
/// Longest shortest value of any part, in bytes: it is built once per grammar and copied into
/// closings, so a `minItems` of a million cannot take the memory or the time of every step.
pub const MAX_SHORTEST: u64 = 64 << 10;
/// Most bytes of all the parts' shortest values together.
const MAX_SHORTEST_TOTAL: u64 = 8 << 20;
/// Most entries of all the alternatives' first-part lists together.
const MAX_STARTS_TOTAL: usize = 1 << 18;

/// Node ids of the parts every grammar has.
const ANY: u32 = 0;
const ANY_OBJECT: u32 = 1;
const ANY_ARRAY: u32 = 2;
const STRING: u32 = 3;
const NUMBER: u32 = 4;
const BOOLEAN: u32 = 5;
const NULL: u32 = 6;

/// A compiled schema.
#[derive(Debug, PartialEq)]
pub struct Grammar {
    nodes: Vec<Node>,
    root: u32,
    /// Per node, its shortest value (`None`: none is finite).
    shortest: Vec<Option<Vec<u8>>>,
    /// Per `anyOf` node, the parts that consume a value's first byte, reached through any
    /// number of nested alternatives and references (empty for other nodes), so starting a
    /// value never recurses through them.
    starts: Vec<Vec<u32>>,
}

#[derive(Debug, PartialEq)]
enum Node {
    /// Any JSON value.
    Any,
    /// An object: its properties in order, and the schema of other keys' values (if any).
    Object { props: Vec<Prop>, extra: Option<u32> },
    /// An array of `items`, `min` to `max` long.
    Array { items: u32, min: u32, max: Option<u32> },
    /// Any string.
    String,
    /// Any number, or any integer.
    Number { integer: bool },
    /// One of these JSON texts (an enum's values, a const, `true`/`false`, `null`).
    Literal(Vec<Vec<u8>>),
    /// Any of these.
    AnyOf(Vec<u32>),
    /// Not compiled yet (a `$ref` being compiled).
    Pending,
}

#[derive(Debug, PartialEq)]
struct Prop {
    /// The key as JSON, past its opening quote, with its closing one.
    key: Vec<u8>,
    node: u32,
    required: bool,
}

/// A schema this server cannot enforce, with the JSON pointer of the part at fault.
#[derive(Debug, PartialEq, Eq)]
pub struct SchemaError {
    /// Where in the schema (`/properties/age`), empty for its root.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = if self.path.is_empty() { "/" } else { &self.path };
        write!(f, "{at}: {}", self.message)
    }
}

/// Keywords that only annotate a schema.
const ANNOTATIONS: [&str; 9] = [
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
];

/// Keywords enforced.
const ENFORCED: [&str; 12] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "$ref",
    "$defs",
];

impl Grammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    pub fn any_object() -> Grammar {
        match Grammar::new(base_nodes(), ANY_OBJECT, &[]) {
            Ok(g) => g,
            Err(e) => unreachable!("the base grammar is within every bound: {e}"),
        }
    }

    /// The grammar of a JSON Schema: `type` (one or a list), `properties`, `required`,
    /// `additionalProperties`, `items`, `minItems`, `maxItems`, `enum`, `const`, `anyOf`,
    /// local `$ref`s into `$defs` or `definitions` (recursion included) and annotations;
    /// any other keyword is an error naming it, never ignored. So is a schema past the bounds
    /// ([`MAX_SCHEMA_DEPTH`], [`MAX_NODES`], [`MAX_SHORTEST`]): whatever a client sends, the
    /// compiler's stack, memory and time are bounded, and so is the matcher's work per byte.
    pub fn from_schema(schema: &Value) -> Result<Grammar, SchemaError> {
        // The bounds make a panic a bug, not a client's doing; still, a bug in here must
        // cost one request its answer, not the engine its life.
        std::panic::catch_unwind(|| Grammar::compile_schema(schema)).unwrap_or_else(|_| {
            Err(Compiler::err("", "this schema could not be compiled (an internal error)"))
        })
    }

    fn compile_schema(schema: &Value) -> Result<Grammar, SchemaError> {
        let mut c = Compiler {
            root: schema,
            nodes: base_nodes(),
            paths: vec![String::new(); base_nodes().len()],
            refs: Vec::new(),
            depth: 0,
        };
        let root = c.compile(schema, "")?;
        let g = Grammar::new(c.nodes, root, &c.paths)?;
        if g.shortest(root).is_none() {
            return Err(Compiler::err("", "no finite value satisfies this schema"));
        }
        Ok(g)
    }

    /// A grammar over `nodes`; `paths` names each node's place in the schema, for errors.
    fn new(nodes: Vec<Node>, root: u32, paths: &[String]) -> Result<Grammar, SchemaError> {
        let path = |id: usize| paths.get(id).map_or("", String::as_str);
        let n = nodes.len();
        let mut g = Grammar { shortest: vec![None; n], starts: vec![Vec::new(); n], nodes, root };
        // The shortest values' lengths first, as numbers, so a value too long to build is
        // refused before a byte of it is.
        let (lens, choice) = g.shortest_lengths();
        let mut total = 0u64;
        for (id, len) in lens.iter().enumerate() {
            let Some(len) = *len else { continue };
            if len > MAX_SHORTEST {
                let what = match g.nodes[id] {
                    Node::Array { min, .. } => format!("minItems {min} makes"),
                    _ => "the schema makes".to_string(),
                };
                return Err(Compiler::err(
                    path(id),
                    format!(
                        "{what} the shortest value here {len} bytes long; at most {MAX_SHORTEST} are allowed"
                    ),
                ));
            }
            total += len;
        }
        if total > MAX_SHORTEST_TOTAL {
            return Err(Compiler::err(
                "",
                format!(
                    "the schema's parts have {total} bytes of shortest values together; at most {MAX_SHORTEST_TOTAL} are allowed"
                ),
            ));
        }
        // Then the values, each from its parts' (built first, without recursion: a chain of
        // parts may be as long as the grammar).
        for id in 0..n {
            let mut work = vec![(id as u32, false)];
            // Each node is pushed at most twice per dependant; the choices have no cycle.
            let mut steps = 0usize;
            while let Some((v, ready)) = work.pop() {
                steps += 1;
                if steps > 8 * n + 8 {
                    break;
                }
                let vi = v as usize;
                if g.shortest[vi].is_some() || lens[vi].is_none() {
                    continue;
                }
                if ready {
                    g.shortest[vi] = g.shortest_of(v);
                    continue;
                }
                work.push((v, true));
                let deps: Vec<u32> = match &g.nodes[vi] {
                    Node::Object { props, .. } => {
                        props.iter().filter(|p| p.required).map(|p| p.node).collect()
                    }
                    Node::Array { items, min, .. } if *min > 0 => vec![*items],
                    Node::AnyOf(_) => vec![choice[vi]],
                    _ => Vec::new(),
                };
                work.extend(deps.into_iter().filter(|&d| d != v).map(|d| (d, false)));
            }
        }
        g.starts = g.alternative_starts().map_err(|m| Compiler::err("", m))?;
        Ok(g)
    }

    /// Each node's shortest value's length (`None`: no finite value), by fixed point over
    /// the nodes in reverse order (a part is mostly compiled after the node holding it), and
    /// per `anyOf` the alternative that last lowered it: a choice is only made by a strict
    /// improvement, so the choices never form a cycle.
    fn shortest_lengths(&self) -> (Vec<Option<u64>>, Vec<u32>) {
        let n = self.nodes.len();
        let mut lens: Vec<Option<u64>> = vec![None; n];
        let mut choice = vec![ANY; n];
        let of = |id: u32, lens: &[Option<u64>]| lens.get(id as usize).copied().flatten();
        for _ in 0..=n {
            let mut changed = false;
            for id in (0..n).rev() {
                let len = match &self.nodes[id] {
                    Node::Any | Node::Number { .. } => Some(1),
                    Node::String => Some(2),
                    Node::Literal(alts) => alts.iter().map(|a| a.len() as u64).min(),
                    Node::AnyOf(alts) => {
                        match alts.iter().filter_map(|&a| Some((of(a, &lens)?, a))).min() {
                            Some((len, a)) => {
                                if lens[id].is_none_or(|old| len < old) {
                                    choice[id] = a;
                                }
                                Some(len)
                            }
                            None => None,
                        }
                    }
                    Node::Object { props, .. } => {
                        let required = props.iter().filter(|p| p.required);
                        let mut len = 2 + (required.clone().count() as u64).saturating_sub(1);
                        let mut finite = true;
                        for p in required {
                            match of(p.node, &lens) {
                                Some(v) => len = len.saturating_add(p.key.len() as u64 + 2 + v),
                                None => finite = false,
                            }
                        }
                        finite.then_some(len)
                    }
                    Node::Array { items, min, .. } => match (*min, of(*items, &lens)) {
                        (0, _) => Some(2),
                        (m, Some(v)) => Some(
                            (v.saturating_add(1)).saturating_mul(u64::from(m)).saturating_add(1),
                        ),
                        (_, None) => None,
                    },
                    Node::Pending => None,
                };
                if len.is_some_and(|l| lens[id].is_none_or(|old| l < old)) {
                    lens[id] = len;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        (lens, choice)
    }

    /// Per `anyOf` node, the distinct non-`anyOf` nodes reached through alternatives alone.
    fn alternative_starts(&self) -> Result<Vec<Vec<u32>>, String> {
        let n = self.nodes.len();
        let mut starts = vec![Vec::new(); n];
        let mut seen = vec![u32::MAX; n];
        let mut total = 0usize;
        for id in 0..n {
            if !matches!(self.nodes[id], Node::AnyOf(_)) {
                continue;
            }
            let mut work = vec![id as u32];
            seen[id] = id as u32;
            while let Some(v) = work.pop() {
                match self.node(v) {
                    Node::AnyOf(alts) => {
                        for &a in alts {
                            if let Some(s) = seen.get_mut(a as usize).filter(|s| **s != id as u32) {
                                *s = id as u32;
                                work.push(a);
                            }
                        }
                    }
                    _ => starts[id].push(v),
                }
            }
            total += starts[id].len();
            if total > MAX_STARTS_TOTAL {
                return Err(format!(
                    "the schema's alternatives reach over {MAX_STARTS_TOTAL} parts together"
                ));
            }
        }
        Ok(starts)
    }

    /// The shortest whole value the grammar allows.
    pub fn shortest_value(&self) -> Option<&[u8]> {
        self.shortest(self.root)
    }

    fn node(&self, id: u32) -> &Node {
        self.nodes.get(id as usize).unwrap_or(&Node::Any)
    }

    fn shortest(&self, id: u32) -> Option<&[u8]> {
        self.shortest.get(id as usize).and_then(Option::as_deref)
    }

    /// A node's shortest value from its parts' values known so far.
    fn shortest_of(&self, id: u32) -> Option<Vec<u8>> {
        match self.node(id) {
            Node::Any | Node::Number { .. } => Some(b"0".to_vec()),
            Node::String => Some(b"\"\"".to_vec()),
            Node::Literal(alts) => alts.iter().min_by_key(|a| a.len()).cloned(),
            Node::AnyOf(alts) => alts
                .iter()
                .filter_map(|&a| self.shortest(a))
                .min_by_key(|v| v.len())
                .map(<[u8]>::to_vec),
            Node::Object { props, .. } => {
                let mut out = b"{".to_vec();
                self.close_props(props, 0, false, &mut out)?;
                Some(out)
            }
            Node::Array { items, min, .. } => {
                let mut out = b"[".to_vec();
                self.close_items(*items, *min, false, &mut out)?;
                Some(out)
            }
            Node::Pending => None,
        }
    }

    /// Appends the required properties from `next` on and the closing brace; `after` says
    /// a property came before (so a comma goes first).
    fn close_props(
        &self,
        props: &[Prop],
        next: usize,
        after: bool,
        out: &mut impl Out,
    ) -> Option<()> {
        let mut first = !after;
        for p in props.iter().skip(next).filter(|p| p.required) {
            if !first {
                out.push(b',');
            }
            first = false;
            out.push(b'"');
            out.extend_from_slice(&p.key);
            out.push(b':');
            out.extend_from_slice(self.shortest(p.node)?);
        }
        out.push(b'}');
        Some(())
    }

    /// Appends `count` more items and the closing bracket; `after` says an item came before.
    fn close_items(&self, items: u32, count: u32, after: bool, out: &mut impl Out) -> Option<()> {
        if count > 0 {
            let item = self.shortest(items)?;
            if !after {
                out.extend_from_slice(item);
            }
            out.repeat(b",", item, count - u32::from(!after));
        }
        out.push(b']');
        Some(())
    }
}

/// Where bytes of a value are written: kept, or only counted.
trait Out {
    fn push(&mut self, b: u8);
    fn extend_from_slice(&mut self, bytes: &[u8]);
    /// `sep` and `bytes`, `times` over.
    fn repeat(&mut self, sep: &[u8], bytes: &[u8], times: u32) {
        for _ in 0..times {
            self.extend_from_slice(sep);
            self.extend_from_slice(bytes);
        }
    }
}

impl Out for Vec<u8> {
    fn push(&mut self, b: u8) {
        Vec::push(self, b);
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        Vec::extend_from_slice(self, bytes);
    }
}

/// Bytes counted, not kept.
struct Count(usize);

impl Out for Count {
    fn push(&mut self, _: u8) {
        self.0 += 1;
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }

    fn repeat(&mut self, sep: &[u8], bytes: &[u8], times: u32) {
        self.0 += (sep.len() + bytes.len()) * times as usize;
    }
}

fn base_nodes() -> Vec<Node> {
    vec![
        Node::Any,
        Node::Object { props: Vec::new(), extra: Some(ANY) },
        Node::Array { items: ANY, min: 0, max: None },
        Node::String,
        Node::Number { integer: false },
        Node::Literal(vec![b"true".to_vec(), b"false".to_vec()]),
        Node::Literal(vec![b"null".to_vec()]),
    ]
}

struct Compiler<'a> {
    root: &'a Value,
    nodes: Vec<Node>,
    /// Per node, where in the schema it was compiled from.
    paths: Vec<String>,
    /// `$ref`s compiled or being compiled, and their nodes.
    refs: Vec<(String, u32)>,
    /// Levels of [`Compiler::compile`] now running.
    depth: usize,
}

impl Compiler<'_> {
    fn err(path: &str, message: impl Into<String>) -> SchemaError {
        SchemaError { path: path.to_string(), message: message.into() }
    }

    fn push(&mut self, node: Node, path: &str) -> Result<u32, SchemaError> {
        if self.nodes.len() >= MAX_NODES {
            let msg = format!(
                "the schema has more than {MAX_NODES} parts; at most that many are allowed"
            );
            return Err(Self::err(path, msg));
        }
        self.nodes.push(node);
        self.paths.push(path.to_string());
        Ok((self.nodes.len() - 1) as u32)
    }

    fn compile(&mut self, schema: &Value, path: &str) -> Result<u32, SchemaError> {
        if self.depth >= MAX_SCHEMA_DEPTH {
            return Err(Self::err(
                path,
                format!(
                    "the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (properties, items, anyOf and $ref each count one)"
                ),
            ));
        }
        self.depth += 1;
        let id = self.compile_level(schema, path);
        self.depth -= 1;
        id
    }

    fn compile_level(&mut self, schema: &Value, path: &str) -> Result<u32, SchemaError> {
        let obj = match schema {
            Value::Bool(true) => return Ok(ANY),
            Value::Object(o) => o,
            _ => return Err(Self::err(path, "a schema must be an object or true")),
        };
        for key in obj.keys() {
            let known = ENFORCED.contains(&key.as_str())
                || ANNOTATIONS.contains(&key.as_str())
                || key == "definitions"
                || key == "strict";
            if !known {
                return Err(Self::err(path, format!("the keyword `{key}` is not supported")));
            }
        }
        if let Some(r) = obj.get("$ref") {
            return self.reference(r, path);
        }
        if let Some(alts) = obj.get("anyOf") {
            let Value::Array(alts) = alts else {
                return Err(Self::err(path, "anyOf must be an array"));
            };
            if alts.is_empty() {
                return Err(Self::err(path, "anyOf must not be empty"));
            }
            let mut ids = Vec::new();
            for (i, alt) in alts.iter().enumerate() {
                ids.push(self.compile(alt, &format!("{path}/anyOf/{i}"))?);
            }
            return self.push(Node::AnyOf(ids), path);
        }
        if let Some(c) = obj.get("const") {
            return self.push(Node::Literal(vec![json_bytes(c)]), path);
        }
        if let Some(e) = obj.get("enum") {
            let Value::Array(values) = e else {
                return Err(Self::err(path, "enum must be an array"));
            };
            if values.is_empty() {
                return Err(Self::err(path, "enum must not be empty"));
            }
            return self.push(Node::Literal(values.iter().map(json_bytes).collect()), path);
        }
        let types: Vec<&str> = match obj.get("type") {
            None if obj.contains_key("properties") => vec!["object"],
            None if obj.contains_key("items") => vec!["array"],
            None => return Ok(ANY),
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => {
                let names: Option<Vec<&str>> = ts.iter().map(Value::as_str).collect();
                names
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| Self::err(path, "type must be a type name or a list of them"))?
            }
            Some(_) => return Err(Self::err(path, "type must be a type name or a list of them")),
        };
        let mut ids = Vec::new();
        for t in types {
            ids.push(match t {
                "string" => STRING,
                "number" => NUMBER,
                "integer" => self.push(Node::Number { integer: true }, path)?,
                "boolean" => BOOLEAN,
                "null" => NULL,
                "object" => self.object(obj, path)?,
                "array" => self.array(obj, path)?,
                other => return Err(Self::err(path, format!("unknown type `{other}`"))),
            });
        }
        if ids.len() == 1 { Ok(ids[0]) } else { self.push(Node::AnyOf(ids), path) }
    }

    fn object(
        &mut self,
        obj: &serde_json::Map<String, Value>,
        path: &str,
    ) -> Result<u32, SchemaError> {
        let required: Vec<&str> = match obj.get("required") {
            None => Vec::new(),
            Some(Value::Array(r)) => r
                .iter()
                .map(Value::as_str)
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| Self::err(path, "required must be a list of property names"))?,
            Some(_) => return Err(Self::err(path, "required must be a list of property names")),
        };
        let empty = serde_json::Map::new();
        let properties = match obj.get("properties") {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(_) => return Err(Self::err(path, "properties must be an object")),
        };
        for name in &required {
            if !properties.contains_key(*name) {
                let msg = format!("required property `{name}` is not among the properties");
                return Err(Self::err(path, msg));
            }
        }
        let mut props = Vec::new();
        for (name, schema) in properties {
            let node = self.compile(schema, &format!("{path}/properties/{}", pointer(name)))?;
            let mut key = json_bytes(&Value::String(name.clone()));
            key.remove(0);
            props.push(Prop { key, node, required: required.contains(&name.as_str()) });
        }
        // Keys beyond the properties only where the schema asks for them by a schema of
        // their values; with properties and no word on others, the properties alone (a
        // subset of what the schema allows, as strict mode has it).
        let extra = match obj.get("additionalProperties") {
            Some(Value::Bool(false)) => None,
            None | Some(Value::Bool(true)) => props.is_empty().then_some(ANY),
            Some(s) => Some(self.compile(s, &format!("{path}/additionalProperties"))?),
        };
        self.push(Node::Object { props, extra }, path)
    }

    fn array(
        &mut self,
        obj: &serde_json::Map<String, Value>,
        path: &str,
    ) -> Result<u32, SchemaError> {
        let items = match obj.get("items") {
            None => ANY,
            Some(s) => self.compile(s, &format!("{path}/items"))?,
        };
        let bound = |name: &str| -> Result<Option<u32>, SchemaError> {
            match obj.get(name) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .map(Some)
                    .ok_or_else(|| Self::err(path, format!("{name} must be a whole number"))),
            }
        };
        let min = bound("minItems")?.unwrap_or(0);
        let max = bound("maxItems")?;
        if max.is_some_and(|m| m < min) {
            return Err(Self::err(path, "maxItems is below minItems"));
        }
        self.push(Node::Array { items, min, max }, path)
    }

    fn reference(&mut self, r: &Value, path: &str) -> Result<u32, SchemaError> {
        let Some(r) = r.as_str() else {
            return Err(Self::err(path, "$ref must be a string"));
        };
        if let Some((_, id)) = self.refs.iter().find(|(name, _)| name == r) {
            return Ok(*id);
        }
        let target = r
            .strip_prefix('#')
            .and_then(|p| self.root.pointer(p))
            .filter(|_| r.starts_with("#/$defs/") || r.starts_with("#/definitions/"))
            .ok_or_else(|| {
                Self::err(path, format!("$ref `{r}` is not a local #/$defs/ or #/definitions/"))
            })?;
        // Allocated before its body, so a recursive reference finds it.
        let id = self.push(Node::Pending, r.trim_start_matches('#'))?;
        self.refs.push((r.to_string(), id));
        let body = self.compile(target, r.trim_start_matches('#'))?;
        self.nodes[id as usize] = Node::AnyOf(vec![body]);
        Ok(id)
    }
}

/// A JSON pointer segment.
fn pointer(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

fn json_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum ObjAt {
    /// After `{`.
    Open,
    /// A key is being read (a free one: a string).
    InKey,
    /// After a key: `:` comes, then a value of this node.
    Colon(u32),
    /// A value is being read.
    InValue,
    /// After a value.
    AfterValue,
    /// After `,`.
    AfterComma,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum ArrAt {
    Open,
    InValue,
    AfterValue,
    AfterComma,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum StrAt {
    Normal,
    Escape,
    /// Hex digits of a `\u` escape still to come.
    Unicode(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum NumAt {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

impl NumAt {
    fn accepting(self) -> bool {
        matches!(self, NumAt::Zero | NumAt::Int | NumAt::Frac | NumAt::ExpDigits)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Frame {
    /// A value of this node is to start.
    Value(u32),
    /// Inside an object: the next property that may come, and where.
    Obj {
        node: u32,
        next: u32,
        at: ObjAt,
    },
    /// Inside a declared key of an object's property.
    Key {
        node: u32,
        prop: u32,
        pos: u32,
    },
    Arr {
        node: u32,
        count: u32,
        at: ArrAt,
    },
    Str(StrAt),
    /// Inside one of a literal node's texts.
    Lit {
        node: u32,
        alt: u32,
        pos: u32,
    },
    Num {
        integer: bool,
        at: NumAt,
        len: u8,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Stack {
    frames: Vec<Frame>,
    /// Whitespace bytes in a row just read.
    ws: u8,
}

/// Where a constrained generation stands.
#[derive(Clone, Debug)]
pub struct Matcher {
    grammar: Arc<Grammar>,
    stacks: Vec<Stack>,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\t' | b'\r')
}

impl Matcher {
    /// At the start of a value of the grammar's root.
    pub fn new(grammar: Arc<Grammar>) -> Matcher {
        let root = grammar.root;
        Matcher { grammar, stacks: vec![Stack { frames: vec![Frame::Value(root)], ws: 0 }] }
    }

    /// Reads `bytes`; false (and the matcher unchanged) when the grammar refuses them.
    pub fn advance(&mut self, bytes: &[u8]) -> bool {
        let mut stacks = self.stacks.clone();
        for &b in bytes {
            let mut next = Vec::new();
            for stack in stacks {
                self.step(stack, b, &mut next);
            }
            if next.is_empty() {
                return false;
            }
            stacks = next;
        }
        self.stacks = stacks;
        true
    }

    /// Whether the grammar would accept `bytes` next.
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        self.clone().advance(bytes)
    }

    /// Whether what was read is a whole value of the root (the end may come).
    pub fn is_complete(&self) -> bool {
        self.stacks.iter().any(|s| match s.frames.as_slice() {
            [] => true,
            [Frame::Num { at, .. }] => at.accepting(),
            _ => false,
        })
    }

    /// Whether every reading is inside a string, past any escape: then bytes other than `"`,
    /// `\` and control characters keep it there.
    pub fn in_plain_string(&self) -> bool {
        self.stacks.iter().all(|s| s.frames.last() == Some(&Frame::Str(StrAt::Normal)))
    }

    /// Whether the root value is closed: nothing but whitespace may follow.
    pub fn is_closed(&self) -> bool {
        self.stacks.iter().any(|s| s.frames.is_empty())
    }

    /// The shortest bytes that complete the root value from here (empty once complete).
    pub fn closing(&self) -> Option<Vec<u8>> {
        let (len, stack) = self.shortest_closing()?;
        let mut out = Vec::with_capacity(len);
        self.closing_of(stack, &mut out)?;
        Some(out)
    }

    /// The length of [`closing`](Self::closing), counted without building it.
    pub fn closing_len(&self) -> Option<usize> {
        self.shortest_closing().map(|(len, _)| len)
    }

    fn shortest_closing(&self) -> Option<(usize, &Stack)> {
        let count = |s| {
            let mut n = Count(0);
            self.closing_of(s, &mut n).map(|()| (n.0, s))
        };
        self.stacks.iter().filter_map(count).min_by_key(|(n, _)| *n)
    }

    fn closing_of<O: Out>(&self, stack: &Stack, out: &mut O) -> Option<()> {
        let g = &*self.grammar;
        // Each frame from the top down, as it stands once the one above it is complete.
        // A declared key on top: the property it names, finished by the key's closing.
        let mut key_done: Option<usize> = None;
        for frame in stack.frames.iter().rev() {
            match *frame {
                Frame::Value(node) => out.extend_from_slice(g.shortest(node)?),
                Frame::Str(at) => {
                    match at {
                        StrAt::Normal => {}
                        StrAt::Escape => out.push(b'n'),
                        StrAt::Unicode(n) => out.extend_from_slice(b"0000".get(..n as usize)?),
                    }
                    out.push(b'"');
                }
                Frame::Num { at, .. } => {
                    if !at.accepting() {
                        out.push(b'0');
                    }
                }
                Frame::Lit { node, alt, pos } => {
                    let Node::Literal(alts) = g.node(node) else { return None };
                    out.extend_from_slice(alts.get(alt as usize)?.get(pos as usize..)?);
                }
                Frame::Key { node, prop, pos } => {
                    let Node::Object { props, .. } = g.node(node) else { return None };
                    let p = props.get(prop as usize)?;
                    out.extend_from_slice(p.key.get(pos as usize..)?);
                    out.push(b':');
                    out.extend_from_slice(g.shortest(p.node)?);
                    // The object goes on after this property, below.
                    key_done = Some(prop as usize);
                    continue;
                }
                Frame::Obj { node, next, at } => {
                    let Node::Object { props, extra } = g.node(node) else { return None };
                    let (next, at) = match (key_done.take(), at) {
                        (Some(prop), _) => (prop + 1, ObjAt::AfterValue),
                        (None, ObjAt::InValue) => (next as usize, ObjAt::AfterValue),
                        (None, ObjAt::InKey) => (next as usize, ObjAt::Colon((*extra)?)),
                        (None, at) => (next as usize, at),
                    };
                    match at {
                        ObjAt::Open => g.close_props(props, next, false, out)?,
                        ObjAt::AfterValue => g.close_props(props, next, true, out)?,
                        ObjAt::Colon(value) => {
                            out.push(b':');
                            out.extend_from_slice(g.shortest(value)?);
                            g.close_props(props, next, true, out)?;
                        }
                        ObjAt::AfterComma => {
                            // A property must come: the first required one, else the next
                            // declared one, else a key of the object's own choosing.
                            let pick = props
                                .iter()
                                .enumerate()
                                .skip(next)
                                .find(|(_, p)| p.required)
                                .or_else(|| props.iter().enumerate().nth(next));
                            match pick {
                                Some((i, p)) => {
                                    out.push(b'"');
                                    out.extend_from_slice(&p.key);
                                    out.push(b':');
                                    out.extend_from_slice(g.shortest(p.node)?);
                                    g.close_props(props, i + 1, true, out)?;
                                }
                                None => {
                                    out.extend_from_slice(b"\"\":");
                                    out.extend_from_slice(g.shortest((*extra)?)?);
                                    out.push(b'}');
                                }
                            }
                        }
                        ObjAt::InKey | ObjAt::InValue => return None,
                    }
                }
                Frame::Arr { node, count, at } => {
                    let Node::Array { items, min, .. } = *g.node(node) else { return None };
                    let (count, at) = match at {
                        ArrAt::InValue => (count + 1, ArrAt::AfterValue),
                        at => (count, at),
                    };
                    let left = min.saturating_sub(count);
                    match at {
                        ArrAt::Open => g.close_items(items, left, false, out)?,
                        ArrAt::AfterValue => g.close_items(items, left, true, out)?,
                        ArrAt::AfterComma => g.close_items(items, left.max(1), false, out)?,
                        ArrAt::InValue => return None,
                    }
                }
            }
        }
        Some(())
    }

    fn push_out(out: &mut Vec<Stack>, stack: Stack) {
        if out.len() < MAX_STACKS && !out.contains(&stack) {
            out.push(stack);
        }
    }

    /// Advances one reading by `b` into `out` (none, one, or several readings).
    fn step(&self, mut stack: Stack, b: u8, out: &mut Vec<Stack>) {
        let white = is_ws(b);
        let ws = if white { stack.ws.saturating_add(1) } else { 0 };
        let Some(&top) = stack.frames.last() else {
            if white && ws <= MAX_WS {
                stack.ws = ws;
                Self::push_out(out, stack);
            }
            return;
        };
        // Whitespace goes where JSON allows it between tokens, a short run at most.
        let between = match top {
            Frame::Value(_) => true,
            Frame::Obj { at, .. } => !matches!(at, ObjAt::InKey | ObjAt::InValue),
            Frame::Arr { at, .. } => at != ArrAt::InValue,
            _ => false,
        };
        if white && between {
            if ws <= MAX_WS {
                stack.ws = ws;
                Self::push_out(out, stack);
            }
            return;
        }
        stack.ws = ws;
        let g = &*self.grammar;
        match top {
            Frame::Value(node) => {
                stack.frames.pop();
                self.start(stack, node, b, out);
            }
            Frame::Obj { node, next, at } => {
                let Node::Object { props, extra } = g.node(node) else { return };
                // Properties that may come next: from `next` up to the first required one.
                let first_required = props
                    .iter()
                    .enumerate()
                    .skip(next as usize)
                    .find(|(_, p)| p.required)
                    .map(|(i, _)| i);
                let upto = first_required.map_or(props.len(), |i| i + 1);
                let may_close = first_required.is_none();
                let eligible = next as usize..upto;
                let set = |stack: &mut Stack, at: ObjAt| {
                    if let Some(Frame::Obj { at: a, .. }) = stack.frames.last_mut() {
                        *a = at;
                    }
                };
                match (at, b) {
                    (ObjAt::Open | ObjAt::AfterComma, b'"') => {
                        for k in eligible {
                            let mut s = stack.clone();
                            s.frames.push(Frame::Key { node, prop: k as u32, pos: 0 });
                            Self::push_out(out, s);
                        }
                        if extra.is_some() {
                            set(&mut stack, ObjAt::InKey);
                            stack.frames.push(Frame::Str(StrAt::Normal));
                            Self::push_out(out, stack);
                        }
                    }
                    (ObjAt::Open, b'}') | (ObjAt::AfterValue, b'}') if may_close => {
                        stack.frames.pop();
                        self.complete(stack, out);
                    }
                    (ObjAt::AfterValue, b',') if !eligible.is_empty() || extra.is_some() => {
                        set(&mut stack, ObjAt::AfterComma);
                        Self::push_out(out, stack);
                    }
                    (ObjAt::Colon(value), b':') if stack.frames.len() < MAX_DEPTH * 2 => {
                        set(&mut stack, ObjAt::InValue);
                        stack.frames.push(Frame::Value(value));
                        Self::push_out(out, stack);
                    }
                    _ => {}
                }
            }
            Frame::Key { node, prop, pos } => {
                let Node::Object { props, .. } = g.node(node) else { return };
                let Some(key) = props.get(prop as usize).map(|p| &p.key) else { return };
                if key.get(pos as usize) != Some(&b) {
                    return;
                }
                if pos as usize + 1 < key.len() {
                    stack.frames.pop();
                    stack.frames.push(Frame::Key { node, prop, pos: pos + 1 });
                    Self::push_out(out, stack);
                    return;
                }
                stack.frames.pop();
                let value = props[prop as usize].node;
                if let Some(Frame::Obj { next, at, .. }) = stack.frames.last_mut() {
                    *next = prop + 1;
                    *at = ObjAt::Colon(value);
                    Self::push_out(out, stack);
                }
            }
            Frame::Arr { node, count, at } => {
                let Node::Array { items, min, max } = *g.node(node) else { return };
                let room = max.is_none_or(|m| count < m);
                match (at, b) {
                    (ArrAt::Open, b']') if min == 0 => {
                        stack.frames.pop();
                        self.complete(stack, out);
                    }
                    (ArrAt::AfterValue, b']') if count >= min => {
                        stack.frames.pop();
                        self.complete(stack, out);
                    }
                    (ArrAt::AfterValue, b',') if room => {
                        if let Some(Frame::Arr { at, .. }) = stack.frames.last_mut() {
                            *at = ArrAt::AfterComma;
                        }
                        Self::push_out(out, stack);
                    }
                    (ArrAt::Open | ArrAt::AfterComma, _) if room => {
                        if let Some(Frame::Arr { at, .. }) = stack.frames.last_mut() {
                            *at = ArrAt::InValue;
                        }
                        self.start(stack, items, b, out);
                    }
                    _ => {}
                }
            }
            Frame::Str(at) => {
                let next = match (at, b) {
                    (StrAt::Normal, b'"') => {
                        stack.frames.pop();
                        self.complete(stack, out);
                        return;
                    }
                    (StrAt::Normal, b'\\') => StrAt::Escape,
                    (StrAt::Normal, 0..0x20) => return,
                    (StrAt::Normal, _) => StrAt::Normal,
                    (StrAt::Escape, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                        StrAt::Normal
                    }
                    (StrAt::Escape, b'u') => StrAt::Unicode(4),
                    (StrAt::Unicode(n), _) if b.is_ascii_hexdigit() => {
                        if n == 1 {
                            StrAt::Normal
                        } else {
                            StrAt::Unicode(n - 1)
                        }
                    }
                    _ => return,
                };
                if let Some(Frame::Str(at)) = stack.frames.last_mut() {
                    *at = next;
                }
                Self::push_out(out, stack);
            }
            Frame::Lit { node, alt, pos } => {
                let Node::Literal(alts) = g.node(node) else { return };
                let Some(text) = alts.get(alt as usize) else { return };
                if text.get(pos as usize) != Some(&b) {
                    return;
                }
                stack.frames.pop();
                if pos as usize + 1 < text.len() {
                    stack.frames.push(Frame::Lit { node, alt, pos: pos + 1 });
                    Self::push_out(out, stack);
                } else {
                    self.complete(stack, out);
                }
            }
            Frame::Num { integer, at, len } => {
                let next = match (at, b) {
                    _ if len >= MAX_NUMBER => None,
                    (NumAt::Minus, b'0') => Some(NumAt::Zero),
                    (NumAt::Minus, b'1'..=b'9') => Some(NumAt::Int),
                    (NumAt::Int, b'0'..=b'9') => Some(NumAt::Int),
                    (NumAt::Zero | NumAt::Int, b'.') if !integer => Some(NumAt::Dot),
                    (NumAt::Dot | NumAt::Frac, b'0'..=b'9') => Some(NumAt::Frac),
                    (NumAt::Zero | NumAt::Int | NumAt::Frac, b'e' | b'E') if !integer => {
                        Some(NumAt::Exp)
                    }
                    (NumAt::Exp, b'+' | b'-') => Some(NumAt::ExpSign),
                    (NumAt::Exp | NumAt::ExpSign | NumAt::ExpDigits, b'0'..=b'9') => {
                        Some(NumAt::ExpDigits)
                    }
                    _ => None,
                };
                stack.frames.pop();
                match next {
                    Some(at) => {
                        stack.frames.push(Frame::Num { integer, at, len: len + 1 });
                        Self::push_out(out, stack);
                    }
                    // The number ends where a byte cannot go on with it: that byte is the
                    // next token's, after the number's value is complete.
                    None if at.accepting() => {
                        let mut done = Vec::new();
                        self.complete(stack, &mut done);
                        for s in done {
                            self.step(s, b, out);
                        }
                    }
                    None => {}
                }
            }
        }
    }

    /// Starts a value of `node` with its first byte `b`: an `anyOf` (a `$ref`) through the
    /// parts its alternatives reach, listed once per grammar, so however deep alternatives
    /// nest or refer to themselves, starting a value does not recurse through them.
    fn start(&self, stack: Stack, node: u32, b: u8, out: &mut Vec<Stack>) {
        match self.grammar.node(node) {
            Node::AnyOf(_) => {
                let starts = self.grammar.starts.get(node as usize).map_or(&[][..], Vec::as_slice);
                for &part in starts {
                    self.start_part(stack.clone(), part, b, out);
                }
            }
            _ => self.start_part(stack, node, b, out),
        }
    }

    /// [`start`](Self::start) for a node other than an `anyOf`.
    fn start_part(&self, mut stack: Stack, node: u32, b: u8, out: &mut Vec<Stack>) {
        if stack.frames.len() >= MAX_DEPTH * 2 || out.len() >= MAX_STACKS {
            return;
        }
        match self.grammar.node(node) {
            Node::Any => {
                let node = match b {
                    b'{' => ANY_OBJECT,
                    b'[' => ANY_ARRAY,
                    b'"' => STRING,
                    b'-' | b'0'..=b'9' => NUMBER,
                    b't' | b'f' => BOOLEAN,
                    b'n' => NULL,
                    _ => return,
                };
                self.start_part(stack, node, b, out);
            }
            Node::Object { .. } if b == b'{' => {
                stack.frames.push(Frame::Obj { node, next: 0, at: ObjAt::Open });
                Self::push_out(out, stack);
            }
            Node::Array { .. } if b == b'[' => {
                stack.frames.push(Frame::Arr { node, count: 0, at: ArrAt::Open });
                Self::push_out(out, stack);
            }
            Node::String if b == b'"' => {
                stack.frames.push(Frame::Str(StrAt::Normal));
                Self::push_out(out, stack);
            }
            Node::Number { integer } => {
                let at = match b {
                    b'-' => NumAt::Minus,
                    b'0' => NumAt::Zero,
                    b'1'..=b'9' => NumAt::Int,
                    _ => return,
                };
                stack.frames.push(Frame::Num { integer: *integer, at, len: 1 });
                Self::push_out(out, stack);
            }
            Node::Literal(alts) => {
                for (i, text) in alts.iter().enumerate() {
                    if text.first() != Some(&b) {
                        continue;
                    }
                    let mut s = stack.clone();
                    if text.len() == 1 {
                        self.complete(s, out);
                    } else {
                        s.frames.push(Frame::Lit { node, alt: i as u32, pos: 1 });
                        Self::push_out(out, s);
                    }
                }
            }
            _ => {}
        }
    }

    /// A value just ended: its parent moves past it.
    fn complete(&self, mut stack: Stack, out: &mut Vec<Stack>) {
        let extra = |node| match self.grammar.node(node) {
            Node::Object { extra, .. } => *extra,
            _ => None,
        };
        match stack.frames.last_mut() {
            Some(Frame::Obj { node, at, .. }) => {
                *at = match (*at, extra(*node)) {
                    (ObjAt::InValue, _) => ObjAt::AfterValue,
                    (ObjAt::InKey, Some(extra)) => ObjAt::Colon(extra),
                    _ => return,
                };
            }
            Some(Frame::Arr { at, count, .. }) => {
                *at = ArrAt::AfterValue;
                *count += 1;
            }
            _ => {}
        }
        Self::push_out(out, stack);
    }
}

/// The vocabulary's byte strings, to count the fewest tokens that spell a closing: how close
/// to its budget a value may come before the grammar steers it shut.
#[derive(Debug, Default)]
pub struct Spelling {
    tokens: HashSet<Box<[u8]>>,
    longest: usize,
}

impl Spelling {
    /// The spelling of a vocabulary given as each token's bytes.
    pub fn new<'t>(tokens: impl IntoIterator<Item = &'t [u8]>) -> Spelling {
        let tokens: HashSet<Box<[u8]>> =
            tokens.into_iter().filter(|b| !b.is_empty()).map(Box::from).collect();
        let longest = tokens.iter().map(|b| b.len()).max().unwrap_or(0);
        Spelling { tokens, longest }
    }

    /// The fewest tokens whose bytes make `s`, `usize::MAX` when none do.
    pub fn tokens(&self, s: &[u8]) -> usize {
        let n = s.len();
        // fewest[i]: the fewest tokens that make s[i..].
        let mut fewest = vec![usize::MAX; n + 1];
        fewest[n] = 0;
        for i in (0..n).rev() {
            for len in 1..=self.longest.min(n - i) {
                let rest = fewest[i + len];
                if rest != usize::MAX && self.tokens.contains(&s[i..i + len]) {
                    fewest[i] = fewest[i].min(rest + 1);
                }
            }
        }
        fewest[0]
    }

    /// Whether a text of `len` bytes might be spelled in fewer than `left` tokens: not when
    /// even the longest tokens would need `left` or more.
    fn within_reach(&self, len: usize, left: usize) -> bool {
        len < left.saturating_mul(self.longest)
    }

    /// Whether `s` is spelled in fewer than `left` tokens, its spelling counted only when its
    /// length leaves it in doubt (so the work is bounded by `left`, not by `s`).
    pub fn fewer_than(&self, s: &[u8], left: usize) -> bool {
        s.len() < left || (self.within_reach(s.len(), left) && self.tokens(s) < left)
    }
}

/// Why a constrained draw could not be made.
#[derive(Debug, PartialEq, Eq)]
pub struct Stuck;

/// Draws the next token of a constrained request, `left` tokens at most being left to it
/// (this one included): the sampler's own choice when the grammar accepts it and the value
/// can still be closed in the tokens left after it, else its choice among the tokens the
/// grammar accepts (the stop tokens once the value is complete), and, when the budget would
/// run out first, among the tokens that follow the grammar's shortest closing and leave the
/// rest of it spellable in time, so the value is closed within the budget whenever the
/// vocabulary can do it. Whether a closing fits is judged by its bytes first (a byte a token
/// is enough) and only near the budget by `spelling`'s fewest tokens, so a value is steered
/// no earlier than it has to be. `bytes` gives a token's bytes (`None`: a special token).
/// The matcher is advanced by the chosen token; the flag says the budget forced it.
#[expect(clippy::too_many_arguments, reason = "one caller in the engine; all distinct")]
pub fn sample_constrained<'t>(
    sampler: &mut Sampler,
    matcher: &mut Matcher,
    logits: &[f32],
    logprobs: Option<usize>,
    bytes: impl Fn(u32) -> Option<&'t [u8]>,
    stops: &[u32],
    spelling: &Spelling,
    left: usize,
) -> Result<(Sampled, bool), Stuck> {
    // The matcher after `t`, when the grammar takes it (a stop once the value is complete).
    let after = |t: u32| {
        if stops.contains(&t) {
            return matcher.is_complete().then(|| matcher.clone());
        }
        let b = bytes(t).filter(|b| !b.is_empty())?;
        let mut m = matcher.clone();
        m.advance(b).then_some(m)
    };
    // Whether the value can still be closed, a byte a token, in the tokens left after `t`,
    // which led to `next`.
    let fits = |next: &Matcher, t: u32| {
        stops.contains(&t)
            || next.closing_len().is_some_and(|n| {
                n < left
                    || (spelling.within_reach(n, left)
                        && next.closing().is_some_and(|c| spelling.fewer_than(&c, left)))
            })
    };
    let mask = |keep: &dyn Fn(&[u8]) -> bool| {
        let mut masked = vec![f32::NEG_INFINITY; logits.len()];
        let mut any = false;
        for (t, (m, &l)) in masked.iter_mut().zip(logits).enumerate() {
            let t = t as u32;
            let ok = if stops.contains(&t) {
                matcher.is_complete()
            } else {
                bytes(t).is_some_and(|b| !b.is_empty() && keep(b))
            };
            if ok {
                *m = l;
                any = true;
            }
        }
        any.then_some(masked)
    };
    let first = sampler.choose(logits);
    let (mut token, mut next) = if let Some(next) = after(first) {
        (first, next)
    } else {
        // Bytes that may come next, so most tokens are judged by their first byte alone.
        let firsts: Vec<bool> = (0..=255u8).map(|b| matcher.accepts(&[b])).collect();
        // Inside a string, a token of plain characters only stays in it: no need to read it.
        let in_string = matcher.in_plain_string();
        let plain = |b: &[u8]| b.iter().all(|&c| c >= 0x20 && c != b'"' && c != b'\\');
        let masked = mask(&|b: &[u8]| {
            firsts[b[0] as usize] && ((in_string && plain(b)) || matcher.accepts(b))
        });
        let t = sampler.choose(&masked.ok_or(Stuck)?);
        (t, after(t).ok_or(Stuck)?)
    };
    let mut forced = false;
    if !fits(&next, token) {
        // The shortest closing from here, as far as a token follows it.
        let closing = matcher.closing().unwrap_or_default();
        let in_time =
            |b: &[u8]| closing.starts_with(b) && spelling.fewer_than(&closing[b.len()..], left);
        if let Some(masked) = mask(&in_time).or_else(|| mask(&|b| closing.starts_with(b))) {
            forced = true;
            token = sampler.choose(&masked);
            next = after(token).ok_or(Stuck)?;
        }
    }
    *matcher = next;
    Ok((sampler.commit(token, logits, logprobs), forced))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn accepts(g: &Arc<Grammar>, text: &str) -> bool {
        let mut m = Matcher::new(Arc::clone(g));
        m.advance(text.as_bytes()) && m.is_complete()
    }

    #[test]
    fn any_object_takes_json_objects_only() {
        let g = Arc::new(Grammar::any_object());
        for ok in [
            "{}",
            r#"{"a": 1}"#,
            r#"{"a": [1, 2.5e-3, -0, "x\"y\u00e9"], "b": {"c": null, "d": true}}"#,
            "{\n  \"k\": false\n}",
        ] {
            assert!(accepts(&g, ok), "{ok}");
        }
        for bad in [
            "[]",
            "1",
            r#"{"a": 01}"#,
            r#"{"a": 1,}"#,
            r#"{"a" 1}"#,
            r#"{"a": tru}"#,
            "{\"a\": \"\u{1}\"}",
            r#"{"a": 1}}"#,
            "{              \"a\": 1}",
        ] {
            assert!(!accepts(&g, bad), "{bad}");
        }
        let mut m = Matcher::new(g);
        assert!(m.advance(b"{\"a\": 12"));
        assert!(!m.is_complete(), "an open object is not complete");
        assert!(m.advance(b"}") && m.is_closed());
    }

    #[test]
    fn a_schema_fixes_keys_order_types_and_enums() -> Result<(), SchemaError> {
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]}
            },
            "required": ["name", "age", "tags"],
            "additionalProperties": false
        });
        let g = Arc::new(Grammar::from_schema(&schema)?);
        for ok in [
            r#"{"name": "x", "age": 3, "tags": []}"#,
            r#"{"name":"x","age":-3,"tags":["a","b"],"nick":null}"#,
            r#"{"name": "x", "age": 0, "tags": ["b"], "nick": "y"}"#,
        ] {
            assert!(accepts(&g, ok), "{ok}");
        }
        for bad in [
            r#"{"age": 3, "name": "x", "tags": []}"#,
            r#"{"name": "x", "tags": []}"#,
            r#"{"name": "x", "age": 3.5, "tags": []}"#,
            r#"{"name": "x", "age": 3, "tags": ["c"]}"#,
            r#"{"name": "x", "age": 3, "tags": ["a", "a", "a"]}"#,
            r#"{"name": "x", "age": 3, "tags": [], "other": 1}"#,
            r#"{"name": 1, "age": 3, "tags": []}"#,
        ] {
            assert!(!accepts(&g, bad), "{bad}");
        }
        Ok(())
    }

    #[test]
    fn refs_recursion_and_refusals() -> Result<(), SchemaError> {
        let schema = json!({
            "$defs": {"Node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                "required": ["v", "kids"]
            }},
            "$ref": "#/$defs/Node"
        });
        let g = Arc::new(Grammar::from_schema(&schema)?);
        assert!(accepts(&g, r#"{"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3, "kids": []}]}"#));
        assert!(!accepts(&g, r#"{"v": 1, "kids": [{"v": 2}]}"#));
        let refused = |schema: Value| Grammar::from_schema(&schema).err().map(|e| e.to_string());
        assert_eq!(
            refused(
                json!({"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}})
            ),
            Some("/properties/a: the keyword `minLength` is not supported".to_string())
        );
        assert_eq!(
            refused(json!({"$ref": "https://example.com/s.json"})),
            Some(
                "/: $ref `https://example.com/s.json` is not a local #/$defs/ or #/definitions/"
                    .to_string()
            )
        );
        // A reference to itself that consumes nothing has no value at all.
        let knot = json!({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"});
        assert_eq!(refused(knot), Some("/: no finite value satisfies this schema".to_string()));
        assert_eq!(
            refused(json!({"type": "object", "required": ["b"], "properties": {}})),
            Some("/: required property `b` is not among the properties".to_string())
        );
        Ok(())
    }

    /// A toy vocabulary: `{`, `}`, `"a"`, `:`, ` `, `1`, `x`, and a stop token.
    const TOY: [&str; 7] = ["{", "}", "\"a\"", ":", " ", "1", "x"];
    const TOY_STOP: u32 = 7;

    fn toy_bytes(t: u32) -> Option<&'static [u8]> {
        TOY.get(t as usize).map(|s| s.as_bytes())
    }

    fn stuck(_: Stuck) -> SchemaError {
        SchemaError { path: String::new(), message: "stuck".into() }
    }

    /// Draws tokens until the value closes or `max` tokens: the text, whether the budget
    /// forced a token.
    fn generate(
        g: &Arc<Grammar>,
        params: crate::sampler::SamplingParams,
        logits: &[f32],
        max: usize,
    ) -> Result<(Vec<u32>, bool), SchemaError> {
        let mut sampler = Sampler::new(params);
        let mut m = Matcher::new(Arc::clone(g));
        let (mut tokens, mut forced) = (Vec::new(), false);
        while !m.is_closed() && tokens.len() < max {
            let left = max - tokens.len();
            let (s, f) = sample_constrained(
                &mut sampler,
                &mut m,
                logits,
                None,
                toy_bytes,
                &[TOY_STOP],
                &Spelling::new(TOY.iter().map(|t| t.as_bytes())),
                left,
            )
            .map_err(stuck)?;
            assert_ne!(s.token, TOY_STOP, "a stop before the value is complete");
            tokens.push(s.token);
            forced |= f;
        }
        Ok((tokens, forced))
    }

    fn text(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|&t| toy_bytes(t).unwrap_or_default().to_vec()).collect()
    }

    #[test]
    fn the_sampler_is_kept_to_the_grammar_whatever_the_logits_say() -> Result<(), SchemaError> {
        let schema =
            json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        let g = Arc::new(Grammar::from_schema(&schema)?);
        // The model would rather say `x` or stop at every step.
        let logits = [0.1, 0.2, 0.3, 0.4, 0.0, 0.15, 1.0, 0.9];
        let (tokens, forced) = generate(&g, Default::default(), &logits, 64)?;
        assert_eq!((tokens, forced), (vec![0, 2, 3, 5, 1], false), "greedy among what is allowed");
        // Sampled at several seeds: always a closed value of the schema.
        for seed in 0..20 {
            let params =
                crate::sampler::SamplingParams { temperature: 1.0, seed, ..Default::default() };
            let text = text(&generate(&g, params, &logits, 200)?.0);
            let v: Result<Value, _> = serde_json::from_slice(&text);
            assert!(v.is_ok_and(|v| v["a"].is_number()), "{}", String::from_utf8_lossy(&text));
        }
        Ok(())
    }

    #[test]
    fn the_value_is_closed_within_the_token_budget() -> Result<(), SchemaError> {
        let schema =
            json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        let g = Arc::new(Grammar::from_schema(&schema)?);
        // The model loves digits: left alone, it writes 24 of them.
        let logits = [0.1, 0.2, 0.3, 0.4, 0.0, 2.0, 1.0, 0.9];
        let (tokens, forced) = generate(&g, Default::default(), &logits, 64)?;
        assert_eq!(text(&tokens), format!("{{\"a\":{}}}", "1".repeat(24)).into_bytes());
        assert!(!forced);
        // Eight tokens: `{`, `"a"`, `:`, four digits, and `}` is forced at the last.
        let (tokens, forced) = generate(&g, Default::default(), &logits, 8)?;
        assert_eq!(text(&tokens), b"{\"a\":1111}".to_vec());
        assert!(forced, "the closing brace came from the budget, not the model");
        // The shortest closings from a few places.
        let mut m = Matcher::new(Arc::clone(&g));
        let mut closings = vec![m.closing()];
        for piece in ["{", "\"", "a\"", ":", "12"] {
            m.advance(piece.as_bytes());
            closings.push(m.closing());
        }
        let want = [r#"{"a":0}"#, r#""a":0}"#, r#"a":0}"#, ":0}", "0}", "}"];
        assert_eq!(closings, want.map(|w| Some(w.as_bytes().to_vec())).to_vec());
        Ok(())
    }

    #[test]
    fn a_closing_is_counted_in_the_fewest_tokens_that_spell_it() {
        let spelling =
            Spelling::new(["{", "\"a\"", ":", "0", "}", "0}", "\"", "a"].map(str::as_bytes));
        assert_eq!(spelling.tokens(br#"{"a":0}"#), 4, "{{ \"a\" : 0}}");
        assert_eq!(spelling.tokens(br#""a":0}"#), 3);
        assert_eq!(spelling.tokens(b""), 0);
        assert_eq!(spelling.tokens(b"]"), usize::MAX, "no token spells it");
    }

    #[test]
    fn every_closing_completes_its_value() -> Result<(), SchemaError> {
        let schema = json!({
            "type": "object",
            "properties": {
                "s": {"type": "string"},
                "o": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"k": {"enum": ["xy", "z"]}}, "required": ["k"]}]},
                "l": {"type": "array", "items": {"type": "number"}, "minItems": 2},
                "f": {"type": "boolean"}
            },
            "required": ["s", "l"]
        });
        let g = Arc::new(Grammar::from_schema(&schema)?);
        let whole = r#"{"s": "a\u00e9", "o": {"k": "xy"}, "l": [1.5e3, -2], "f": false}"#;
        for cut in 0..whole.len() {
            let mut m = Matcher::new(Arc::clone(&g));
            assert!(m.advance(&whole.as_bytes()[..cut]), "{cut}");
            let closing = m.closing().unwrap_or_default();
            assert!(
                m.advance(&closing) && m.is_closed(),
                "{} + {}",
                &whole[..cut],
                String::from_utf8_lossy(&closing)
            );
        }
        Ok(())
    }

    /// `{"$defs": {"d0": {"$ref": "#/$defs/d1"}, ..., "d{n-1}": {"type": "string"}}}`, rooted
    /// at `d0`: a chain of `n` references.
    fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let d = if i + 1 < n {
                json!({"$ref": format!("#/$defs/d{}", i + 1)})
            } else {
                json!({"type": "string"})
            };
            defs.insert(format!("d{i}"), d);
        }
        json!({"$defs": defs, "$ref": "#/$defs/d0"})
    }

    #[test]
    fn a_long_chain_of_references_is_refused_by_name_and_a_short_one_works() -> Result<(), String> {
        // Run where the stack is a tokio worker's (2 MiB): a chain of 3,000 once overflowed it.
        let outcome = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                let mut out = Vec::new();
                for n in [1, 11, 12, 40, 63, 64, 1000, 3000] {
                    let g = Grammar::from_schema(&ref_chain(n));
                    out.push((n, g.map(Arc::new).map_err(|e| e.to_string())));
                }
                out
            })
            .map(|h| h.join());
        let Ok(Ok(outcome)) = outcome else { return Err("the compiler's thread died".into()) };
        for (n, g) in outcome {
            if n < MAX_SCHEMA_DEPTH {
                // Once 11 hops through references left no byte that could start the value.
                let g = g.map_err(|e| format!("a chain of {n}: {e}"))?;
                assert!(accepts(&g, r#""abc""#), "a chain of {n}");
                assert!(!accepts(&g, "1"), "a chain of {n}");
            } else {
                let e = g.err().unwrap_or_default();
                assert!(e.contains("nests deeper than 64 levels"), "a chain of {n}: {e}");
            }
        }
        Ok(())
    }

    #[test]
    fn values_too_long_to_build_are_refused_before_they_are_built() -> Result<(), SchemaError> {
        let refused = |schema: Value| Grammar::from_schema(&schema).err().map(|e| e.to_string());
        // Three nested arrays of 3,000 would have taken 3.4 GB to write out.
        let nested = json!({"type": "array", "minItems": 3000, "items": {"type": "array",
            "minItems": 3000, "items": {"type": "array", "minItems": 3000, "items": {"type": "string"}}}});
        let e = refused(nested).unwrap_or_default();
        assert!(e.starts_with("/items: minItems 3000 makes the shortest value here"), "{e}");
        assert!(e.ends_with("at most 65536 are allowed"), "{e}");
        let wide = json!({"type": "array", "items": {"type": "string"}, "minItems": 1_000_000});
        assert_eq!(
            refused(wide),
            Some("/: minItems 1000000 makes the shortest value here 3000001 bytes long; at most 65536 are allowed".into())
        );
        let huge = json!({"type": "array", "items": {"type": "string"}, "minItems": u32::MAX});
        assert!(refused(huge).is_some_and(|e| e.contains("minItems 4294967295")));
        // Within the bound: built, and its closing is the whole of it.
        let fine = json!({"type": "array", "items": {"type": "integer"}, "minItems": 1000});
        let g = Arc::new(Grammar::from_schema(&fine)?);
        let want = format!("[{}0]", "0,".repeat(999)).into_bytes();
        assert_eq!(g.shortest_value(), Some(&want[..]));
        assert_eq!(Matcher::new(Arc::clone(&g)).closing_len(), Some(want.len()));
        // Too many parts.
        let many: serde_json::Map<String, Value> =
            (0..5000).map(|i| (format!("p{i}"), json!({"type": "integer"}))).collect();
        let e = refused(json!({"type": "object", "properties": many})).unwrap_or_default();
        assert!(e.contains("more than 4096 parts"), "{e}");
        Ok(())
    }

    #[test]
    fn alternatives_that_refer_to_themselves_start_values_through_their_way_out()
    -> Result<(), SchemaError> {
        let schema = json!({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
            "B": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "integer"}, {"enum": ["x"]}]}},
            "$ref": "#/$defs/A"});
        let g = Arc::new(Grammar::from_schema(&schema)?);
        assert!(accepts(&g, "12") && accepts(&g, r#""x""#) && !accepts(&g, r#""y""#));
        assert_eq!(g.shortest_value(), Some(&b"0"[..]));
        Ok(())
    }

    /// Bytes the grammar holds for its shortest values and alternatives' lists.
    fn footprint(g: &Grammar) -> usize {
        let values: usize = g.shortest.iter().flatten().map(Vec::len).sum();
        let starts: usize = g.starts.iter().map(Vec::len).sum();
        values + 4 * starts + g.nodes.len() * std::mem::size_of::<Node>()
    }

    fn fuzz_schema() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let min_items =
            prop_oneof![0u64..4, Just(3000u64), Just(1_000_000), Just(u64::from(u32::MAX))];
        let leaf = prop_oneof![
            Just(json!({"type": "string"})),
            Just(json!({"type": "integer"})),
            Just(json!({"type": ["number", "null"]})),
            Just(json!({"type": "boolean"})),
            Just(json!(true)),
            prop::collection::vec("[a-z\\u{e9}\"]{0,3}", 1..4).prop_map(|v| json!({"enum": v})),
            Just(json!({"$ref": "#/$defs/d0"})),
            Just(json!({"$ref": "#/$defs/d1"})),
        ];
        let node = leaf.prop_recursive(8, 96, 4, move |inner| {
            prop_oneof![
                (inner.clone(), min_items.clone(), proptest::option::of(0u64..6)).prop_map(
                    |(items, min, extra)| {
                        let mut a = json!({"type": "array", "items": items, "minItems": min});
                        if let Some(e) = extra {
                            a["maxItems"] = json!(min.saturating_add(e));
                        }
                        a
                    }
                ),
                prop::collection::vec(("[a-c]{1,2}", inner.clone(), any::<bool>()), 0..4).prop_map(
                    |props| {
                        let required: Vec<&String> =
                            props.iter().filter(|p| p.2).map(|p| &p.0).collect();
                        let map: serde_json::Map<String, Value> =
                            props.iter().map(|p| (p.0.clone(), p.1.clone())).collect();
                        let required: Vec<&String> =
                            required.into_iter().filter(|k| map.contains_key(*k)).collect();
                        json!({"type": "object", "properties": map, "required": required})
                    }
                ),
                prop::collection::vec(inner, 1..4).prop_map(|alts| json!({"anyOf": alts})),
            ]
        });
        (node.clone(), node.clone(), node)
            .prop_map(|(root, d0, d1)| json!({"$defs": {"d0": d0, "d1": d1}, "anyOf": [root]}))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256),
            ..Default::default()
        })]

        /// Generated schemas, hostile sizes included: every compile ends soon with a grammar
        /// of bounded size or an error, and every grammar's shortest value is JSON it takes,
        /// whose closings from any point complete it.
        #[test]
        fn generated_schemas_compile_within_bounds(schema in fuzz_schema()) {
            let started = std::time::Instant::now();
            let compiled = Grammar::from_schema(&schema);
            let took = started.elapsed();
            proptest::prop_assert!(took < std::time::Duration::from_secs(2), "compiling took {took:?}");
            if let Ok(g) = compiled {
                proptest::prop_assert!(footprint(&g) < 64 << 20, "{} bytes", footprint(&g));
                let g = Arc::new(g);
                let value = g.shortest_value().map(<[u8]>::to_vec).unwrap_or_default();
                proptest::prop_assert!(serde_json::from_slice::<Value>(&value).is_ok());
                proptest::prop_assert!(accepts(&g, &String::from_utf8_lossy(&value)));
                let step = (value.len() / 64).max(1);
                for cut in (0..value.len()).step_by(step) {
                    let mut m = Matcher::new(Arc::clone(&g));
                    proptest::prop_assert!(m.advance(&value[..cut]));
                    let closing = m.closing().unwrap_or_default();
                    proptest::prop_assert_eq!(Some(closing.len()), m.closing_len());
                    proptest::prop_assert!(m.advance(&closing) && m.is_complete());
                }
            }
        }
    }
}
