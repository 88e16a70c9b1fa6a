//! A received ring message's arrays as numpy arrays over the chunk in place (zero-copy), for
//! the bindings (`bindings/shm.rs`): each array keeps the ring's mapping alive through an owner
//! object, so no view outlives the memory it reads.
use std::sync::Arc;

use numpy::ndarray::{ArrayViewD, IxDyn};
use numpy::{Element, PyArray, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::segment::Segment;
use super::shm_ring::{DType, ItemRef, ItemView, Message, Reader};

/// An array to publish, as the ring's item of type `dtype` (the array's own, checked by the
/// caller): its C-contiguous bytes read in place. A numpy read-only borrow per array (the
/// checked alternative) costs ~8 µs a step at 1,024 running decodes (benches/RESULTS.md).
pub fn item_of_array<'a>(
    array: &'a Bound<'_, PyUntypedArray>,
    dtype: DType,
) -> PyResult<ItemRef<'a>> {
    if !array.is_c_contiguous() {
        return Err(PyValueError::new_err("arrays must be C-contiguous"));
    }
    if array.dtype().is_native_byteorder() == Some(false) {
        return Err(PyValueError::new_err(format!(
            "arrays of dtype {} cannot travel through the ring (native byte order only)",
            array.dtype()
        )));
    }
    let shape = array.shape();
    let nbytes = shape.iter().product::<usize>() * dtype.size();
    if nbytes == 0 {
        return Ok(ItemRef {
            dtype,
            shape,
            bytes: &[],
        });
    }
    // SAFETY: a C-contiguous array of `shape`'s elements of `dtype` (its own element type, of
    // `dtype.size()` bytes) holds exactly `nbytes` initialised bytes at its data pointer. The
    // bytes live as long as the array object, which `array` keeps alive for 'a; the ring reads
    // them during `publish`, which holds the GIL throughout, so no Python code can resize or
    // free the array meanwhile.
    let bytes = unsafe {
        let data = (*array.as_array_ptr()).data as *const u8;
        std::slice::from_raw_parts(data, nbytes)
    };
    Ok(ItemRef {
        dtype,
        shape,
        bytes,
    })
}

/// The base object of the arrays of a message: holds the mapping they view.
#[pyclass(module = "pagedllm._core", name = "ShmRingMapping", frozen)]
struct Mapping(#[allow(dead_code)] Arc<Segment>);

/// `message`'s arrays (None for an absent item), viewing its chunk of `reader`'s mapping. The
/// bytes are the writer's until `reader.ack()` (the ring's protocol); the memory stays mapped
/// while any of the arrays lives.
pub fn item_arrays<'py>(
    py: Python<'py>,
    reader: &Reader,
    message: &Message,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mapping = reader.mapping();
    let owner = Bound::new(py, Mapping(Arc::clone(mapping)))?.into_any();
    message
        .items
        .iter()
        .map(|item| match item {
            None => Ok(py.None().into_bound(py)),
            Some(item) => Ok(match item.dtype {
                DType::Bool => array::<bool>(mapping, message, item, &owner)?,
                DType::U8 => array::<u8>(mapping, message, item, &owner)?,
                DType::I16 => array::<i16>(mapping, message, item, &owner)?,
                DType::I32 => array::<i32>(mapping, message, item, &owner)?,
                DType::I64 => array::<i64>(mapping, message, item, &owner)?,
                DType::F32 => array::<f32>(mapping, message, item, &owner)?,
                DType::F64 => array::<f64>(mapping, message, item, &owner)?,
            }),
        })
        .collect()
}

fn array<'py, T: Element>(
    mapping: &Segment,
    message: &Message,
    item: &ItemView,
    owner: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let (base, start) = (
        mapping.as_ptr() as usize,
        message.chunk as usize + item.offset,
    );
    let elements = item.shape.iter().product::<usize>();
    let inside = start >= base
        && start + item.nbytes <= base + mapping.len()
        && item.nbytes == elements * std::mem::size_of::<T>()
        && start.is_multiple_of(std::mem::align_of::<T>());
    if !inside {
        return Err(PyValueError::new_err(
            "a ring item lies outside its reader's mapping (a message of another ring?)",
        ));
    }
    // SAFETY: checked just above: the item's `nbytes` bytes lie inside `mapping`, aligned for T
    // and exactly the shape's elements; the writer encoded them from an array of T (a bool item
    // from numpy's bools, 0 or 1), and Rust never reads them here. `owner` holds the mapping,
    // and numpy keeps `owner` alive as the array's base, so the memory outlives the array.
    let array = unsafe {
        let view = ArrayViewD::from_shape_ptr(IxDyn(&item.shape), start as *const T);
        PyArray::<T, IxDyn>::borrow_from_array(&view, owner.clone())
    };
    Ok(array.into_any())
}
