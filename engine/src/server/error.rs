//! Errors as OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`.

use axum::Json;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sluice_wire::ErrorBody;

use crate::error::EngineError;

/// An HTTP error response in OpenAI's shape. Every failure of the server ends up here, so no
/// client ever sees a plain-text error or a hang.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message (never contains prompt text).
    pub message: String,
    /// OpenAI error `type`.
    pub kind: &'static str,
    /// The request parameter at fault, as a path (`messages[1].role`).
    pub param: Option<String>,
    /// Machine-readable code.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 about the request as a whole (malformed JSON, not an object).
    pub fn invalid_body(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// Sets the machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// 401: the internal token is missing or wrong.
    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or invalid bearer token".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 404 for a path this server does not have.
    pub fn no_route(method: &str, path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no route for {method} {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: format!("{path} does not accept {method}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    /// 404: no request with this id is remembered.
    pub fn unknown_request(id: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no request `{id}` is remembered by this engine"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_not_found"),
        }
    }

    /// 404: the request names a model this engine does not serve.
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{model}` does not exist on this engine"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 500: the engine failed while running the request.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 503: the engine thread is gone.
    pub fn unavailable() -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the engine has stopped".into(),
            kind: "server_error",
            param: None,
            code: Some("engine_unavailable"),
        }
    }

    /// Maps an engine error; `param` names the request parameter a validation failure is
    /// about.
    pub fn from_engine(err: &EngineError, param: Option<&str>) -> ApiError {
        let message = err.to_string();
        match err {
            EngineError::InvalidRequest(_)
            | EngineError::Template(_)
            | EngineError::Tokenizer(_) => ApiError {
                status: StatusCode::BAD_REQUEST,
                message,
                kind: "invalid_request_error",
                param: param.map(str::to_string),
                code: None,
            },
            EngineError::Unavailable(_) => ApiError::unavailable(),
            EngineError::Io { .. }
            | EngineError::Format { .. }
            | EngineError::Unsupported(_)
            | EngineError::Fetch(_)
            | EngineError::Device(_)
            | EngineError::Interrupted
            | EngineError::Baseline(_) => ApiError::internal(message),
        }
    }

    /// The body could not be read (too large, connection error).
    pub fn from_body_rejection(rejection: &BytesRejection) -> ApiError {
        ApiError {
            status: rejection.status(),
            message: format!("reading the request body: {}", rejection.body_text()),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody::new(&self.message, self.kind, self.param.as_deref(), self.code);
        (self.status, Json(body)).into_response()
    }
}
