//! `Tensor`: a shape, a dtype and a storage. Storage is the one place where
//! the device is dispatched on (candle's `enum Storage { Cpu, Cuda }`).
//!
//! The CPU engine computes in f32: checkpoints in bf16/f16 are widened once at
//! load. Integer ids (token ids, positions) are u32.

use crate::{Device, Error, Result};
use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
    U32,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U32 => "u32",
        };
        f.write_str(s)
    }
}

/// Host memory, one variant per dtype.
#[derive(Debug, Clone)]
pub enum CpuStorage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    U32(Vec<u32>),
}

/// Where a tensor's elements live.
#[derive(Debug, Clone)]
pub enum Storage {
    Cpu(CpuStorage),
    /// Reserved for the CUDA backend; never constructed in this build.
    Cuda(CudaStandIn),
    /// The elements were dropped because another form of them (a matrix
    /// packed for the product) is what is read now: the tensor keeps its
    /// shape, dtype and identity, and every read of its data is an error.
    Released(DType),
}

/// Uninhabited stand-in for device memory in builds without CUDA.
#[derive(Debug, Clone)]
pub enum CudaStandIn {}

#[derive(Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
    id: TensorId,
}

/// A tensor's identity: unique within the process, kept through in-place
/// writes, a reshape and [`Tensor::release`]; a clone is a new tensor with
/// a new identity. Derived data (a packed copy of a weight) is found by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorId(u64);

impl TensorId {
    fn next() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        TensorId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Clone for Tensor {
    fn clone(&self) -> Self {
        Tensor {
            shape: self.shape.clone(),
            storage: self.storage.clone(),
            id: TensorId::next(),
        }
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    fn checked(shape: &[usize], len: usize, storage: CpuStorage) -> Result<Self> {
        if numel(shape) != len {
            return Err(Error::Shape(format!(
                "shape {shape:?} holds {} elements, data has {len}",
                numel(shape)
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Storage::Cpu(storage),
            id: TensorId::next(),
        })
    }

    pub fn from_f32(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let n = data.len();
        Self::checked(shape, n, CpuStorage::F32(data))
    }
    pub fn from_bf16(data: Vec<bf16>, shape: &[usize]) -> Result<Self> {
        let n = data.len();
        Self::checked(shape, n, CpuStorage::BF16(data))
    }
    pub fn from_f16(data: Vec<f16>, shape: &[usize]) -> Result<Self> {
        let n = data.len();
        Self::checked(shape, n, CpuStorage::F16(data))
    }
    pub fn from_u32(data: Vec<u32>, shape: &[usize]) -> Result<Self> {
        let n = data.len();
        Self::checked(shape, n, CpuStorage::U32(data))
    }
    pub fn zeros(shape: &[usize]) -> Self {
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::Cpu(CpuStorage::F32(vec![0.0; numel(shape)])),
            id: TensorId::next(),
        }
    }

    /// A tensor of `shape` and `dtype` whose elements are not held (see
    /// [`Storage::Released`]): a placeholder to be filled, or a parameter
    /// read only in another form.
    pub fn released(shape: &[usize], dtype: DType) -> Self {
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::Released(dtype),
            id: TensorId::next(),
        }
    }

    /// Drop the elements, keeping shape, dtype and identity.
    pub fn release(&mut self) {
        self.storage = Storage::Released(self.dtype());
    }

    pub fn is_released(&self) -> bool {
        matches!(self.storage, Storage::Released(_))
    }

    /// Bytes of elements held (0 once released).
    pub fn held_bytes(&self) -> usize {
        match self.storage {
            Storage::Released(_) => 0,
            _ => self.numel() * self.dtype().size_in_bytes(),
        }
    }

    pub fn id(&self) -> TensorId {
        self.id
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::Cpu(CpuStorage::F32(_)) => DType::F32,
            Storage::Cpu(CpuStorage::BF16(_)) => DType::BF16,
            Storage::Cpu(CpuStorage::F16(_)) => DType::F16,
            Storage::Cpu(CpuStorage::U32(_)) => DType::U32,
            Storage::Cuda(s) => match *s {},
            Storage::Released(dt) => *dt,
        }
    }
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Cpu(_) | Storage::Released(_) => Device::Cpu,
            Storage::Cuda(s) => match *s {},
        }
    }
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Reinterpret with a new shape of the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        if numel(shape) != self.numel() {
            return Err(Error::Shape(format!(
                "cannot reshape {:?} to {shape:?}",
                self.shape
            )));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// Widen to f32 (a copy for bf16/f16, a move for f32).
    pub fn to_f32(self) -> Result<Self> {
        let shape = self.shape;
        let id = self.id;
        let data = match self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => v,
            Storage::Cpu(CpuStorage::BF16(v)) => v.iter().map(|x| x.to_f32()).collect(),
            Storage::Cpu(CpuStorage::F16(v)) => v.iter().map(|x| x.to_f32()).collect(),
            Storage::Cpu(CpuStorage::U32(_)) => {
                return Err(Error::DType {
                    expected: "a float dtype".into(),
                    got: "u32".into(),
                })
            }
            Storage::Cuda(s) => match s {},
            Storage::Released(_) => return Err(Error::Released(format!("{shape:?}"))),
        };
        Ok(Tensor {
            shape,
            storage: Storage::Cpu(CpuStorage::F32(data)),
            id,
        })
    }

    /// Borrow f32 host data.
    pub fn as_f32(&self) -> Result<&[f32]> {
        match &self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v),
            Storage::Released(_) => Err(self.released_error()),
            _ => Err(Error::DType {
                expected: "f32".into(),
                got: self.dtype().to_string(),
            }),
        }
    }
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        let dt = self.dtype();
        if self.is_released() {
            return Err(self.released_error());
        }
        match &mut self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v),
            _ => Err(Error::DType {
                expected: "f32".into(),
                got: dt.to_string(),
            }),
        }
    }
    pub fn as_u32(&self) -> Result<&[u32]> {
        match &self.storage {
            Storage::Cpu(CpuStorage::U32(v)) => Ok(v),
            Storage::Released(_) => Err(self.released_error()),
            _ => Err(Error::DType {
                expected: "u32".into(),
                got: self.dtype().to_string(),
            }),
        }
    }
}

impl Tensor {
    fn released_error(&self) -> Error {
        Error::Released(format!("{:?} {}", self.shape, self.dtype()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A released tensor keeps shape, dtype and identity and refuses every
    /// read with an error; a clone is a new identity.
    #[test]
    fn released_tensors_refuse_reads() {
        let mut t = Tensor::from_f32(vec![1.0; 6], &[2, 3]).unwrap();
        let id = t.id();
        assert_ne!(t.clone().id(), id);
        assert_eq!(t.held_bytes(), 24);
        t.as_f32_mut().unwrap()[0] = 2.0;
        assert_eq!(t.id(), id);
        t.release();
        assert!(t.is_released());
        assert_eq!(
            (t.id(), t.shape(), t.dtype(), t.held_bytes()),
            (id, &[2usize, 3][..], DType::F32, 0)
        );
        let e = t.as_f32().unwrap_err().to_string();
        assert!(e.contains("released"), "{e}");
        assert!(t.as_f32_mut().is_err() && t.clone().to_f32().is_err());
        let r = Tensor::released(&[4], DType::BF16);
        assert_eq!((r.numel(), r.dtype(), r.held_bytes()), (4, DType::BF16, 0));
    }

    #[test]
    fn shape_is_checked() {
        assert!(Tensor::from_f32(vec![0.0; 5], &[2, 3]).is_err());
        let t = Tensor::from_f32(vec![1.0; 6], &[2, 3]).unwrap();
        assert_eq!(t.dtype(), DType::F32);
        assert_eq!(t.device(), Device::Cpu);
        assert!(t.clone().reshape(&[4]).is_err());
        assert_eq!(t.reshape(&[3, 2]).unwrap().shape(), &[3, 2]);
    }

    #[test]
    fn bf16_widens() {
        let t = Tensor::from_bf16(vec![bf16::from_f32(1.5), bf16::from_f32(-2.0)], &[2]).unwrap();
        assert_eq!(t.to_f32().unwrap().as_f32().unwrap(), &[1.5, -2.0]);
        assert!(Device::Cuda(0).check_available().is_err());
    }
}
